"""Vision-language models: what a sample's images become on the trainer's side (the multimodal
rotary positions), computed by one rule for every forward."""
