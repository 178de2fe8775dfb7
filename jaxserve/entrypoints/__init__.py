"""User-facing entry points: the `jaxserve` command line (`cli/`), the OpenAI-compatible HTTP
server (`openai/`), batch files (`run_batch.py`, and on a Ray cluster `ray_batch.py`), chat
templates and the terminal chat."""
