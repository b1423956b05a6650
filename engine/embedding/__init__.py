"""The encoder engine: sentence embeddings from a BERT-family sentence-transformers folder.

`EmbeddingEngine` (add_request / step / abort, `tokenize`, `max_input_tokens`), `EmbeddingConfig`, and its
messages (`EmbeddingRequest` in, `EmbeddingOutput` out). The package `engine` exports all of them (loaded on
first use, so its light modules import without torch); callers import from there. Inside: loader.py reads the
folder's pipeline, tokenizer.py frames and cuts inputs as the reference does, bert.py is the forward (its
linear layers in linear.py, its dtype chosen by precision.py), pooling.py makes one vector per input,
scheduler.py decides what each forward embeds, engine.py drives them; frontend.py is the tokenizer and limits
without the weights.
"""
