"""OpenAI's protocol, as Sluice serves it: the request and response shapes (schema), tool calling in one
documented format (tools), log-probabilities (logprobs), what a request asks of its answer (shape), and
the answer's encoders: streamed chunks (chunks) and the JSON body (answer). No transport and no state:
the HTTP layer reads requests with these and writes what they encode."""
