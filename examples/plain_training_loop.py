"""A plain PyTorch training loop (a tiny LSTM language model on random data, nothing from resihp)
with resihp attached: three added lines, no change to the model.

    python examples/plain_training_loop.py --steps 50 --out runs/example
    resihp detect runs/example

While it runs, each step's ops are appended to runs/example/ranks/rank0.jsonl and
runs/example/heartbeats/rank0.json is refreshed twice a second; a side process detects live with

    resihp follow runs/example      # started before or after the job

or, inside the job, ``resihp.attach(..., detect=True)`` and ``monitor.report()``.
"""

import argparse
import random

import torch
from torch import nn

import resihp


class TinyLM(nn.Module):
    def __init__(self, vocab=512, dim=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.out(h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="runs/example")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = resihp.attach(model, optimizer=opt, out=args.out)  # <- resihp
    for _ in range(args.steps):
        lengths = [random.randint(16, 128) for _ in range(4)]
        ids = torch.randint(0, 512, (4, max(lengths)))
        with monitor.step(seq_lens=lengths):  # <- resihp
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    monitor.close()  # <- resihp
    trace = monitor.trace()
    print(f"recorded {len(trace)} ops over {trace.step.nunique()} steps into {args.out}")


if __name__ == "__main__":
    main()
