"""DeepSeek-V4: its config, tensor names, the forward over requests that each carry their own
state (sliding window, compressed entries, the indexer's keys, the compressors' partial
windows), and a tiny V4 from a seed."""
