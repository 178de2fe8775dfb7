"""Unit tests of the device-side runner helpers (jaxserve/runner/)."""
