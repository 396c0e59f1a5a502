"""Train a small GPT-2 from scratch with the Hugging Face Trainer on synthetic token ids.

A script as people write them from the transformers examples: a config (random weights, nothing
downloaded), a Dataset, TrainingArguments, Trainer.train(). Small by default so it runs on a CPU:

    python hf_trainer.py --bf16 --max-steps 3
    python hf_trainer.py --attn-implementation eager --bug attn-scale

--bug changes the config or the model the way a user might (see BUGS).
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, set_seed

BUGS = {
    "none": "no bug",
    "ln-eps": "config layer_norm_epsilon=1e-6 (copied from a LLaMA config) instead of GPT-2's 1e-5",
    "gelu": 'config activation_function="gelu" (exact erf GELU) instead of GPT-2\'s "gelu_new" (tanh)',
    "attn-scale": "config scale_attn_weights=False: attention scores not divided by sqrt(head_dim)",
    "layer-scale": "config scale_attn_by_inverse_layer_idx=True: block i's scores divided by i + 1",
    "softmax-bf16": "a custom attention function (AttentionInterface) whose softmax runs in bfloat16",
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output-dir", default="out-hf-trainer")
parser.add_argument("--bf16", action="store_true", help="mixed precision (autocast) through TrainingArguments")
parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=32)
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--vocab-size", type=int, default=96)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--num-samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
parser.add_argument("--max-steps", type=int, default=3)
parser.add_argument("--learning-rate", type=float, default=5e-4)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--bug", default="none", choices=sorted(BUGS))
args = parser.parse_args()


class RandomTokens(Dataset):
    """Synthetic language-model data: token ids drawn once from a fixed seed; labels are the inputs
    (the model shifts them)."""

    def __init__(self, num_samples, seq_len, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        pattern = torch.randint(0, vocab_size, (seq_len + 7,), generator=g)
        rows = [torch.roll(pattern, -int(s))[:seq_len] for s in torch.randint(0, 7, (num_samples,), generator=g)]
        self.input_ids = torch.stack(rows)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def bf16_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention, but the softmax in bfloat16 to save activation memory."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    else:  # GPT-2 is causal
        q_len, k_len = query.shape[-2], key.shape[-2]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        attn_weights = attn_weights.masked_fill(~causal, torch.finfo(attn_weights.dtype).min)
    attn_weights = torch.nn.functional.softmax(attn_weights.to(torch.bfloat16), dim=-1).to(value.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2)
    return attn_output, attn_weights


def main():
    set_seed(args.seed)
    config_kwargs = dict(
        vocab_size=args.vocab_size,
        n_positions=args.seq_len,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    attn_implementation = args.attn_implementation
    if args.bug == "ln-eps":
        config_kwargs["layer_norm_epsilon"] = 1e-6
    elif args.bug == "gelu":
        config_kwargs["activation_function"] = "gelu"
    elif args.bug == "attn-scale":
        config_kwargs["scale_attn_weights"] = False
    elif args.bug == "layer-scale":
        config_kwargs["scale_attn_by_inverse_layer_idx"] = True
    elif args.bug == "softmax-bf16":
        from transformers import AttentionInterface

        AttentionInterface.register("bf16_softmax", bf16_softmax_attention)
        attn_implementation = "bf16_softmax"
    config = GPT2Config(**config_kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, attention {attn_implementation}")

    train_dataset = RandomTokens(args.num_samples, args.seq_len, args.vocab_size, args.seed)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        bf16=args.bf16,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    result = trainer.train()
    print(f"train_loss {result.training_loss:.6f}")


if __name__ == "__main__":
    main()
