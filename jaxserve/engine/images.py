"""An engine's images: the `ImageSupport` its input processor uses when the served checkpoint
has a vision tower (`Worker.vision`), and the settings images cannot be served with."""

from __future__ import annotations

from jaxserve.multimodal.support import image_support


def engine_images(engine):
    """The `jaxserve.multimodal.support.ImageSupport` of `engine`'s model, or None when it
    takes no images.

    Raises:
        ValueError: `max_num_batched_tokens` below one image's placeholders (a chunk
            never splits an image that attends both ways, so one must fit a step), or a
            draft model (it would not see the images).
    """
    tower = engine.worker.vision
    if tower is None:
        return None
    mm = engine.config.multimodal
    support = image_support(tower.hf_config, engine.tokenizer, engine.model.source,
                            mm.media_limits(), mm.max_images)
    per_image = support.max_image_tokens
    budget = engine.limits.max_num_batched_tokens
    if support.layout.bidirectional and budget < per_image:
        raise ValueError(f"max_num_batched_tokens={budget} is below the {per_image} tokens of "
                         "one image, which a step computes whole")
    spec = engine.config.speculative_config
    if spec is not None and getattr(spec, "method", None) not in (None, "ngram"):
        raise ValueError(f"speculative_config method {spec.method!r} is not served with "
                         "images (its draft would not see them); n-gram speculation is")
    engine.runner.set_vision(tower, support.layout.bidirectional, per_image)
    return support
