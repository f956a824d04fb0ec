"""Attention processor class names that the diffusers and the ppdiffusers adapters both sort processors by
(framework-free): ppdiffusers keeps diffusers' names for the processors it ports, so each adapter's sets are
these shared ones and the processors only its library has."""

# The classic, sliced and xformers processors: a whole-batch ``attention_mask`` added to scores they compute
# themselves, and keys and values computed through ``to_k``/``to_v`` from ``encoder_hidden_states`` when a
# self-attention is given one.
CLASSIC = frozenset({"AttnProcessor", "SlicedAttnProcessor", "XFormersAttnProcessor"})
# Their IP-Adapter and custom-diffusion twins: the mask added the same way, keys and values their own way.
MASKED_TWINS = frozenset({
    "IPAdapterAttnProcessor", "IPAdapterXFormersAttnProcessor",
    "CustomDiffusionAttnProcessor", "CustomDiffusionXFormersAttnProcessor",
})
