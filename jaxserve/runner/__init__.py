"""Device side of a step: the `ModelRunner` and the helpers it builds and runs steps with."""
