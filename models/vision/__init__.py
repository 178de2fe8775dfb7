"""Vision encoders of the image-text families: each turns one preprocessed image
(`jaxserve.multimodal.processors`) into the embeddings its placeholder tokens take."""
