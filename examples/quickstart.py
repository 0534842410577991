# quickstart.py: train a small Hugging Face GPT-2 on 2 CPU ranks with fxpar.
#   python quickstart.py                          (fxpar.launch spawns the ranks)
#   torchrun --nproc-per-node 2 quickstart.py     (torchrun spawns them)
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fxpar


def batches(n, size=8, seq=32, vocab=512):
    g = torch.Generator().manual_seed(0)        # the same data on every rank
    for _ in range(n):
        ids = torch.randint(0, vocab, (size, seq), generator=g)
        yield {"input_ids": ids, "labels": ids}  # a dict batch: the loss is model(**batch).loss


def train(world_size=2):
    torch.manual_seed(0)                        # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    data = list(batches(20))
    pm = fxpar.parallelize(
        model,
        world_size,                             # world size | ["cuda:0", ...] | a DeviceMesh
        example_batch=data[0],                  # one GLOBAL batch: tensor, tuple or dict
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),  # default: SGD(lr=1e-3)
        plan="auto",                            # or fxpar.Plan(dp=2), or {"dp": 2}
    )
    for step, batch in enumerate(data):
        loss = pm.step(batch)                   # the global batch; same loss on every rank
    # collective calls (step, evaluate, full_state_dict, save, ...): call them on EVERY rank
    val = pm.evaluate(data[0])                  # forward only, no update
    state = pm.full_state_dict()                # full weights, keys as in model.state_dict()
    if int(os.environ.get("RANK", 0)) == 0:     # print on one rank only
        print(f"plan {pm.plan}: loss {loss.item():.3f}, eval {val.item():.3f}, "
              f"{len(state)} tensors")
    return loss.item()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:              # started by torchrun
        train(int(os.environ["WORLD_SIZE"]))
    else:
        fxpar.launch(train, 2)
