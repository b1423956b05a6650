"""5. The hop between gateways and engine workers: in-process (`memory`) or shared through Redis."""
