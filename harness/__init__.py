"""kvbench: measure and explain what the KV cache costs and buys during LLM decoding."""
