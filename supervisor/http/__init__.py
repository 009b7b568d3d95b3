"""The HTTP front end: the Falcon app, the generation pipeline every dialect shares, one module per
dialect (OpenAI, Responses, Anthropic, Ollama, llama-server), the dashboard's static files."""
