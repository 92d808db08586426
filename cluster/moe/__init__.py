"""The MoE routing control plane: one controller per serving app, steering every model's expert routing."""
