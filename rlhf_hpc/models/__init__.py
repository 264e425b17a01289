"""The models as transformers builds them: actor/critic/reward construction and tiny test models
(``hf``), attention kernels, tokenizers, the tested architectures, the real checkpoint."""
