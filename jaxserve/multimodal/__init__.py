"""Images in requests: loading (`media`), preprocessing per family (`processors`)."""
