"""The DeepSeek models: V3 here (config, checkpoint loading, MLA and MoE layers, the batched forward
over a paged latent KV pool, sampling and the tokenizer) and V4 in `model/v4/`."""
