"""The DeepSeek-V3 model: config, checkpoint loading, MLA and MoE layers, the batched forward
over a paged latent KV pool, sampling and the tokenizer."""
