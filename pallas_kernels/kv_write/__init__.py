"""KV write: scatter a step's new K/V into the page pool by slot mapping."""
