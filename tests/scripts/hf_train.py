"""A Hugging Face Trainer script, written as people write them (transformers' examples/pytorch/language-modeling/
run_clm.py: get_last_checkpoint, then train(resume_from_checkpoint=...)): a tiny GPT-2 built from a config in
the script, synthetic tokens, no download. Nothing of hpc_train in it.

    torchrun --nproc-per-node 2 tests/scripts/hf_train.py --out /tmp/hf
    hpc-train submit cluster=dev cluster.tasks_per_node=1 "script.checkpoint='{ckpt_dir}/checkpoint-*/'" -- \
        python tests/scripts/hf_train.py --out {ckpt_dir}

The Trainer has no handler for a stop: the TERM kills it, and the next attempt resumes from the newest
checkpoint-N/ folder, losing the steps since (at most --save-every).
"""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

p = argparse.ArgumentParser()
p.add_argument("--out", default="hf_out")  # TrainingArguments.output_dir: its checkpoint-N/ folders
p.add_argument("--max-steps", type=int, default=50)
p.add_argument("--save-every", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.15)  # a sleep per step: saves >= 3 s apart, a stop lands between
args = p.parse_args()

VOCAB, SEQ = 64, 32


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same for an index in any attempt."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Report(TrainerCallback):
    """The step each process starts at (after a resume, the checkpoint's), and a sleep per step."""

    def __init__(self, step_time: float) -> None:
        self.step_time = step_time

    def on_train_begin(self, args, state, control, **kwargs):
        env = os.environ
        print(
            f"hf process_index={args.process_index} RANK={env.get('RANK')}"
            f" attempt={env.get('TORCHELASTIC_RESTART_COUNT', '-')} start_step={state.global_step}",
            flush=True,
        )

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.step_time)


config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ)
training_args = TrainingArguments(
    output_dir=args.out,
    max_steps=args.max_steps,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    save_strategy="steps",
    save_steps=args.save_every,
    save_total_limit=2,
    logging_steps=10,
    use_cpu=True,
    report_to=[],
    dataloader_num_workers=0,
    disable_tqdm=True,
    log_level="info",  # the Trainer's own "Resuming training from checkpoint ... global step N"
    seed=0,
)
trainer = Trainer(
    model=GPT2LMHeadModel(config), args=training_args, train_dataset=Tokens(), callbacks=[Report(args.step_time)]
)
last = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
trainer.train(resume_from_checkpoint=last)
if trainer.is_world_process_zero():
    print(f"finished at step {trainer.state.global_step}", flush=True)
