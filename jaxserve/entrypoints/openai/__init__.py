"""The OpenAI-compatible server: protocol models, endpoint handlers and the FastAPI app."""
