"""The built-in GPT as a transformers GPT2LMHeadModel with the same function: GPT-2's Conv1D weights are our Linear
weights transposed, its biases (which our GPT has not) zero, exact GELU, LayerNorm eps 1e-5, the head tied."""

from __future__ import annotations

import torch

from diloco_trainer.model.gpt import GPT


def gpt2_config(gpt: GPT):
    from transformers import GPT2Config

    c = gpt.cfg
    return GPT2Config(vocab_size=c.vocab_size, n_positions=c.seq_len, n_embd=c.d_model, n_layer=c.n_layers,
                      n_head=c.n_heads, n_inner=c.mlp_ratio * c.d_model, activation_function="gelu",
                      resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=1e-5,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


def gpt2_state_dict(gpt: GPT) -> dict[str, torch.Tensor]:
    """GPT-2 tensor names -> values, from the GPT's parameters."""
    sd = {"transformer.wte.weight": gpt.tok_emb.weight, "transformer.wpe.weight": gpt.pos_emb.weight,
          "transformer.ln_f.weight": gpt.ln_f.weight, "transformer.ln_f.bias": gpt.ln_f.bias}
    for i, block in enumerate(gpt.blocks):
        h = f"transformer.h.{i}."
        linears = {"attn.c_attn": block.attn.qkv, "attn.c_proj": block.attn.proj,
                   "mlp.c_fc": block.mlp[0], "mlp.c_proj": block.mlp[2]}
        for name, linear in linears.items():
            sd[h + name + ".weight"] = linear.weight.t()  # Conv1D keeps (in, out)
            sd[h + name + ".bias"] = torch.zeros(linear.out_features)
        for ours, theirs in ((block.ln1, "ln_1"), (block.ln2, "ln_2")):
            sd[h + theirs + ".weight"], sd[h + theirs + ".bias"] = ours.weight, ours.bias
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def gpt_to_gpt2(gpt: GPT):
    """A GPT2LMHeadModel (fp32, eval mode) whose logits equal gpt(idx)'s."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(gpt))
    sd = gpt2_state_dict(gpt)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd) - {"lm_head.weight"})
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:  # an invariant of this mapping, not a user's mistake
        raise AssertionError(f"GPT-2 mapping out of date: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, value in sd.items():
            own[name].copy_(value)
    model.tie_weights()
    return model.eval()
