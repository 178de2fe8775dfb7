"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over latent pages: reference, XLA, Pallas."""
