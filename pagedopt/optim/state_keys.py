"""The keys of a parameter's optimizer state, as pagedopt, bitsandbytes and torch name them, and
the error every refused checkpoint raises."""

BNB_NESTED_KEY = "__bnb_optimizer_quant_state__"
MOMENT_KEYS = ("state1", "state2")
ABSMAX_KEYS = ("absmax1", "absmax2")
QMAP_KEYS = ("qmap1", "qmap2")
TORCH_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# The layout of a DTensor parameter's sharded absmax in a state dict (see sharding.py).
ABSMAX_LAYOUT_KEY = "absmax_layout"
# Keys of torch.optim.Adam/AdamW param groups that mean nothing here; they are dropped on load
# (amsgrad and maximize only when False: True is refused).
TORCH_GROUP_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                     "decoupled_weight_decay")


def refuse(what: str) -> ValueError:
    return ValueError(f"checkpoint refused, nothing was loaded: {what}")
