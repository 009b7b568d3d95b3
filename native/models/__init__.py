"""The model library: finding models (folders, the Hugging Face cache, Ollama's blobs, Python
packages), pulling them, and what a file is and needs (inspect, plan). Not the engine: it reads
GGUF headers, it runs nothing."""
