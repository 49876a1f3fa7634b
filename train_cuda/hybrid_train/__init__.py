"""Distillation of Llama/Mistral teachers into hybrid Mamba/Mamba2/DSLA students for mlx-hybrid."""
