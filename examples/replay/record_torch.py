#!/usr/bin/env python3
"""Records a PyTorch model's device allocations as a gpucache replay log (examples/replay).

Runs the model on a GPU with ``torch.cuda.memory._record_memory_history``, marks the steps,
takes ``torch.cuda.memory._snapshot()`` and writes the log in the CSV format documented at the
top of ``src/replay/mod.rs``::

    op,cache,buffer,bytes,elem,dims
    enter,train_step,,,,
    alloc,train_step,1,2097152,1,2097152
    free,,1,,,
    exit,train_step,,,,

One ``enter``/``exit`` pair per step; ``alloc`` for each ``alloc`` action of the device trace made
inside a step, ``free`` for its ``free_requested`` (inside or after its step). Sizes are the
caching allocator's block sizes, in bytes; torch gives no shape, so ``elem`` is 1 and ``dims`` the
byte count. Buffers allocated before the first step (weights, inputs made ahead) are left out,
and so are their frees; buffers allocated between steps too.

Steps are delimited by marker allocations: after ``torch.cuda.synchronize()``, an allocation of
one distinctive size freed at once, then one of another, four consecutive trace entries that the
log leaves out. Their count is checked against the steps run, and the trace must hold the marker
made when recording started, with fewer entries than ``max_entries``: a truncated trace fails.

Built-in models (random weights, from configs; no network needed)::

    python3 examples/replay/record_torch.py gpt2-train resnet-train bert-infer gpt2-decode \
        vit-train effnet-infer llama-serve convnext-infer opt-serve \
        bert-eager-infer gpt2-infer resnet18-infer vit-infer \
        t5-train llama-ckpt-train bert-dynpad swin-infer densenet-infer frcnn-infer \
        mistral-decode mobilenet-vary-train resnet-epochs-train gpt2-vary-train \
        --out /tmp/logs            # writes /tmp/logs/<model>.csv.gz
    python3 examples/replay/record_torch.py detectors --out /tmp/logs   # five detectors
    python3 examples/replay/record_torch.py tiny --out /tmp   # a self-check of the recorder

Your own model::

    import record_torch
    rec = record_torch.Recorder("train_step")
    with rec:                       # records from here
        for _ in range(8):
            with rec.step():        # one scope of the log
                train_step()        # whatever it allocates inside is logged
    rec.write("my_model.csv.gz")    # then: cargo run --release --example replay -- my_model.csv.gz
"""

import argparse
import contextlib
import gzip
import os
import sys
import time

import torch

# Marker sizes: multiples of 512 (the caching allocator's rounding) that no model is likely to
# allocate twice in a row, below 1 MiB (the small pool: no new segment for a marker).
MARK_A = 512 * 1223
MARK_B = 512 * 1201
MAX_ENTRIES = 4_000_000


class Recorder:
    """Records the device allocations of the steps run inside ``with rec.step():``."""

    def __init__(self, cache="step", device=None, max_entries=MAX_ENTRIES):
        self.cache = cache
        self.device = torch.device(device if device is not None else "cuda")
        self.max_entries = max_entries
        self.marks = 0  # markers made
        self.step_marks = []  # (begin mark index, end mark index) per step
        self.wall_us = []  # unix time (us) after each marker, to cross-check time_us
        self.snapshot = None

    def _mark(self):
        torch.cuda.synchronize(self.device)
        a = torch.empty(MARK_A, dtype=torch.uint8, device=self.device)
        del a
        b = torch.empty(MARK_B, dtype=torch.uint8, device=self.device)
        del b
        torch.cuda.synchronize(self.device)
        self.wall_us.append(time.time_ns() // 1000)
        self.marks += 1
        return self.marks - 1

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=self.max_entries
        )
        self._mark()  # the start: must be in the trace, or the ring lost entries
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return False

    @contextlib.contextmanager
    def step(self):
        begin = self._mark()
        yield
        end = self._mark()
        self.step_marks.append((begin, end))

    def ops(self):
        """The log's operations, as (op, buffer, bytes) tuples, and a few counts."""
        if self.snapshot is None:
            raise RuntimeError("the recording has not ended")
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        trace = self.snapshot["device_traces"][index]
        if len(trace) >= self.max_entries:
            raise RuntimeError(
                f"the trace has {len(trace)} entries, max_entries is {self.max_entries}: "
                "it may be truncated; raise max_entries"
            )
        events = [e for e in trace if e["action"] in ("alloc", "free_requested")]
        # Find the markers: alloc A, free A, alloc B, free B, consecutive among these events.
        mark_at = []
        i = 0
        while i + 3 < len(events):
            a, fa, b, fb = events[i : i + 4]
            if (
                a["action"] == "alloc" and a["size"] == MARK_A
                and fa["action"] == "free_requested" and fa["addr"] == a["addr"]
                and b["action"] == "alloc" and b["size"] == MARK_B
                and fb["action"] == "free_requested" and fb["addr"] == b["addr"]
            ):
                mark_at.append(i)
                i += 4
            else:
                i += 1
        if len(mark_at) != self.marks:
            a = [k for k, e in enumerate(events) if e["action"] == "alloc" and e["size"] == MARK_A]
            print(f"record_torch: allocations of the marker's size at {a[:20]}; events there: "
                  f"{[(e['action'], e['size']) for e in events[a[0]:a[0] + 6]] if a else []}",
                  file=sys.stderr)
            raise RuntimeError(
                f"found {len(mark_at)} step markers in the trace, made {self.marks}: "
                "the trace is truncated (raise max_entries) or a marker size clashed"
            )
        # Cross-check of the clocks: the trace's time_us of each marker's last entry against the
        # wall time taken after it (diagnostic only; the markers delimit the steps).
        skew = [t - events[m + 3].get("time_us", 0) for m, t in zip(mark_at, self.wall_us)]
        skip = set()
        for m in mark_at:
            skip.update(range(m, m + 4))
        step_of = {}
        for s, (b, e) in enumerate(self.step_marks):
            for k in range(mark_at[b] + 4, mark_at[e]):
                step_of[k] = s
        streams = {events[k].get("stream", 0) for k in step_of if events[k]["action"] == "alloc"}
        info = {
            "entries": len(trace),
            "streams": len(streams),
            "clock_skew_us": (min(skew), max(skew)) if skew else None,
        }
        return self._with_scopes(events, mark_at, skip, step_of), info

    def _with_scopes(self, events, mark_at, skip, step_of):
        ops = []
        live = {}
        next_id = 0
        starts = {mark_at[b] + 4: s for s, (b, _) in enumerate(self.step_marks)}
        ends = {mark_at[e]: s for s, (_, e) in enumerate(self.step_marks)}
        for k in range(len(events) + 1):
            if k in starts and ends.get(k) == starts[k]:  # a step with no allocation or free
                ops += [("enter", None, None), ("exit", None, None)]
            else:
                if k in ends:
                    ops.append(("exit", None, None))
                if k in starts:
                    ops.append(("enter", None, None))
            if k == len(events) or k in skip:
                continue
            e = events[k]
            if e["action"] == "alloc":
                if k not in step_of:
                    live.pop(e["addr"], None)
                    continue
                next_id += 1
                live[e["addr"]] = next_id
                ops.append(("alloc", next_id, e["size"]))
            else:
                buf = live.pop(e["addr"], None)
                if buf is not None:
                    ops.append(("free", buf, None))
        return ops

    def csv(self):
        ops, info = self.ops()
        c = self.cache
        lines = ["op,cache,buffer,bytes,elem,dims"]
        for op, buf, size in ops:
            if op == "enter":
                lines.append(f"enter,{c},,,,")
            elif op == "exit":
                lines.append(f"exit,{c},,,,")
            elif op == "alloc":
                lines.append(f"alloc,{c},{buf},{size},1,{size}")
            else:
                lines.append(f"free,,{buf},,,")
        return "\n".join(lines) + "\n", ops, info

    def write(self, path):
        text, ops, info = self.csv()
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "wt") as f:
            f.write(text)
        summary = summarize(ops)
        print(
            f"{path}: {len(self.step_marks)} steps, {summary['allocs']} allocations, "
            f"peak live {summary['peak_live'] / 2**20:.1f} MiB, "
            f"{info['entries']} trace entries, {info['streams']} stream(s), "
            f"wall - time_us after markers {info['clock_skew_us']} us",
            flush=True,
        )
        return summary


def summarize(ops):
    live, size_of, peak, allocs = 0, {}, 0, 0
    for op, buf, size in ops:
        if op == "alloc":
            size_of[buf] = size
            live += size
            allocs += 1
            peak = max(peak, live)
        elif op == "free":
            live -= size_of.pop(buf)
    return {"peak_live": peak, "allocs": allocs}


# ---- built-in models ----------------------------------------------------------------------------


def record_tiny(out):
    """A self-check: known allocations inside and outside steps."""
    dev = torch.device("cuda")
    w = torch.randn(1024, 1024, device=dev)  # before the steps: left out
    kept = []
    rec = Recorder("tiny")
    with rec:
        outside = torch.empty(3 << 20, dtype=torch.uint8, device=dev)  # outside: left out
        for i in range(3):
            with rec.step():
                x = torch.randn(256, 1024, device=dev)  # 1 MiB
                y = x @ w  # 1 MiB
                kept.append(torch.empty(2 << 20, dtype=torch.uint8, device=dev))  # freed later
                del x, y
        del outside, kept[:]
    text, ops, info = rec.csv()
    s = summarize(ops)
    kinds = [o[0] for o in ops]
    assert kinds.count("enter") == 3 and kinds.count("exit") == 3, kinds
    # randn's 1 MiB, the matmul's 1 MiB, the kept 2 MiB per step (randn may use a temporary).
    assert s["allocs"] >= 9, (s, ops)
    assert all(size != 3 << 20 for o, _, size in ops if o == "alloc"), ops
    # The kept buffers live across steps; the three are freed after the last step.
    assert kinds[-3:] == ["free"] * 3, ops[-6:]
    assert s["peak_live"] >= 3 * (2 << 20) + (2 << 20), s
    print(f"tiny: ok ({s['allocs']} allocations, peak live {s['peak_live']} bytes)", flush=True)
    rec.write(os.path.join(out, "tiny.csv.gz"))


def record_gpt2_train(out, steps=8, batch=8, seq=256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def loss(m, _):
        return m(input_ids=ids, labels=ids).loss

    data = [None] * steps
    return record_train(out, "gpt2_train", model, data, loss, adamw(1e-4), keep_loss=False)


def record_resnet_train(out, steps=8, batch=32):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    lossf = torch.nn.CrossEntropyLoss()

    def loss(m, _):
        return lossf(m(x), y)

    data = [None] * steps
    return record_train(out, "resnet50_train", model, data, loss, sgd(0.1), keep_loss=False)


def record_bert_infer(out, steps=10, batch=8):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = BertModel(BertConfig()).to(dev).eval()  # bert-base: 12 layers, 768 wide
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 513, (steps,), generator=gen).tolist()
    inputs = [torch.randint(0, 30522, (batch, n), generator=gen) for n in lengths]

    def step(ids):
        ids = ids.to(dev)
        return model(input_ids=ids).last_hidden_state.sum().item()

    rec = Recorder("infer")
    with torch.no_grad(), rec:
        for ids in inputs:
            with rec.step():
                step(ids)
    print(f"bert-infer: sequence lengths {lengths}", flush=True)
    return rec.write(os.path.join(out, "bert_infer.csv.gz"))


def record_gpt2_decode(out, tokens=48, batch=4, prompt=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()  # gpt2 (124M): 12 layers, 768 wide
    ids = torch.randint(0, 50257, (batch, prompt), device=dev)
    state = {"past": None, "next": ids}

    def step():
        o = model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
        state["past"] = o.past_key_values
        state["next"] = o.logits[:, -1:].argmax(-1)

    rec = Recorder("decode")
    with torch.no_grad(), rec:
        for _ in range(tokens + 1):  # the prompt, then one token a step
            with rec.step():
                step()
        state.clear()
    return rec.write(os.path.join(out, "gpt2_decode.csv.gz"))


def record_vit_train(out, steps=8, batch=32):
    """A vision transformer (timm's ViT-S/16) trained with AdamW and mixed precision."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    lossf = torch.nn.CrossEntropyLoss()

    def loss(m, _):
        return lossf(m(x), y)

    data = [None] * steps
    return record_train(
        out, "vit_train", model, data, loss, adamw(1e-4), bf16=True, keep_loss=False
    )


def record_llama_serve(out, requests=6, new_tokens=12, batch=2):
    """A small Llama-style decoder serving requests one after another: each a prompt step of a
    random length, then one step per new token with a growing KV cache (one scope per step, so
    prompt and decode steps alternate in one scope)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    return record_serve(out, "llama", LlamaForCausalLM(cfg), requests, new_tokens, batch)


def record_opt_serve(out, requests=5, new_tokens=16, batch=4):
    """OPT-125m (a learned-position decoder, no grouped attention) serving requests as
    `llama-serve` does, with another batch and more tokens per request."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return record_serve(out, "opt", OPTForCausalLM(OPTConfig()), requests, new_tokens, batch)


def record_serve(out, name, model, requests, new_tokens, batch):
    """Serves `requests` prompts of random lengths with `model` (made after seeding torch's
    generator with 0), one scope per step."""
    dev = torch.device("cuda")
    model = model.to(dev).eval()
    cfg = model.config
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(16, 385, (requests,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (batch, n), generator=gen) for n in lengths]

    rec = Recorder("serve")
    with torch.no_grad(), rec:
        for ids in prompts:
            state = {"past": None, "next": ids.to(dev)}
            for _ in range(new_tokens + 1):  # the prompt, then one token a step
                with rec.step():
                    o = model(input_ids=state["next"], past_key_values=state["past"], use_cache=True)
                    state["past"] = o.past_key_values
                    state["next"] = o.logits[:, -1:].argmax(-1)
            state.clear()
    print(f"{name}-serve: prompt lengths {lengths}", flush=True)
    return rec.write(os.path.join(out, f"{name}_serve.csv.gz"))


def record_effnet_infer(out, steps=10):
    """torchvision's EfficientNet-B0 in inference, the batch varying every step (1 to 64 images)."""
    import torchvision

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torchvision.models.efficientnet_b0().to(dev).eval()
    gen = torch.Generator().manual_seed(3)
    batches = torch.randint(1, 65, (steps,), generator=gen).tolist()
    rec = Recorder("infer")
    with torch.no_grad(), rec:
        for b in batches:
            with rec.step():
                x = torch.randn(b, 3, 224, 224, device=dev)
                model(x).softmax(-1).argmax(-1)
    print(f"effnet-infer: batches {batches}", flush=True)
    return rec.write(os.path.join(out, "effnet_infer.csv.gz"))


def record_convnext_infer(out, steps=10):
    """timm's ConvNeXt-T in inference under bf16 autocast, the batch varying every step (1 to
    48 images)."""
    import timm

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = timm.create_model("convnext_tiny", pretrained=False).to(dev).eval()
    gen = torch.Generator().manual_seed(4)
    batches = torch.randint(1, 49, (steps,), generator=gen).tolist()
    rec = Recorder("infer")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), rec:
        for b in batches:
            with rec.step():
                x = torch.randn(b, 3, 224, 224, device=dev)
                model(x).float().softmax(-1).argmax(-1)
    print(f"convnext-infer: batches {batches}", flush=True)
    return rec.write(os.path.join(out, "convnext_infer.csv.gz"))


def record_varying(out, name, model, inputs, run):
    """Inference of `model` on `inputs`, one step each (their shapes vary): writes
    ``<out>/<name>.csv.gz``."""
    rec = Recorder("infer")
    with torch.no_grad(), rec:
        for x in inputs:
            with rec.step():
                run(x)
    return rec.write(os.path.join(out, f"{name}.csv.gz"))


def record_lengths(out, name, model, vocab, most, seed, run, steps=12, batch=4):
    """`model` on `batch` sequences of random tokens (below `vocab`) whose length varies every
    step (16 to `most`); `run` calls it on a batch of token ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, most + 1, (steps,), generator=gen).tolist()
    print(f"{name}: sequence lengths {lengths}", flush=True)
    inputs = [torch.randint(0, vocab, (batch, n), generator=gen) for n in lengths]
    return record_varying(out, name, model, inputs, run)


def record_bert_eager_infer(out):
    """BERT-base with eager attention (its scores are batch x heads x length x length: they grow
    with the square of the length, the rest linearly), the length varying every step."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    config = BertConfig()
    config._attn_implementation = "eager"
    model = BertModel(config).to(dev).eval()

    def run(ids):
        return model(input_ids=ids.to(dev)).last_hidden_state.sum().item()

    return record_lengths(out, "bert_eager_infer", model, 30522, 512, 11, run)


def record_gpt2_infer(out):
    """GPT-2 small scoring sequences whose length varies every step (16 to 1024 tokens)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()

    def run(ids):
        return model(input_ids=ids.to(dev)).logits.argmax(-1).sum().item()

    return record_lengths(out, "gpt2_infer", model, 50257, 1024, 12, run)


def record_vision_infer(out, name, make, most, seed, steps=12):
    """A torchvision model in inference, the batch varying every step (1 to `most` images)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = make().to(dev).eval()
    gen = torch.Generator().manual_seed(seed)
    batches = torch.randint(1, most + 1, (steps,), generator=gen).tolist()
    print(f"{name}: batches {batches}", flush=True)
    return record_varying(
        out,
        name,
        model,
        batches,
        lambda b: model(torch.randn(b, 3, 224, 224, device=dev)).argmax(-1).sum().item(),
    )


def record_resnet18_infer(out):
    import torchvision

    return record_vision_infer(out, "resnet18_infer", torchvision.models.resnet18, 96, 13)


def record_vit_infer(out):
    import torchvision

    return record_vision_infer(out, "vit_infer", torchvision.models.vit_b_16, 32, 14)


def adamw(lr):
    """An optimizer maker for `record_train`: AdamW at learning rate `lr`."""
    return lambda params: torch.optim.AdamW(params, lr=lr)


def sgd(lr):
    """An optimizer maker for `record_train`: SGD with momentum 0.9 at learning rate `lr`."""
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def record_t5_train(out, steps=8, batch=16, src=256, tgt=64):
    """T5-small (an encoder-decoder) trained with AdamW on fixed-length inputs and targets."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(num_layers=6, num_heads=8, decoder_start_token_id=0, pad_token_id=0)
    x = torch.randint(1, cfg.vocab_size, (batch, src), device="cuda")
    y = torch.randint(1, cfg.vocab_size, (batch, tgt), device="cuda")

    def loss(m, _):
        return m(input_ids=x, labels=y).loss

    model = T5ForConditionalGeneration(cfg)
    data = [None] * steps
    return record_train(out, "t5_train", model, data, loss, adamw(1e-4), keep_loss=False)


def record_llama_ckpt_train(out, steps=8, batch=4, seq=512):
    """A Llama-style decoder (8 layers, 768 wide, GQA 12/4) trained with gradient checkpointing,
    bf16 autocast and AdamW (its first step makes the optimizer's state in the middle)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def loss(m, _):
        return m(input_ids=ids, labels=ids).loss

    data = [None] * steps
    return record_train(
        out, "llama_ckpt_train", model, data, loss, adamw(1e-4), bf16=True, keep_loss=False
    )


def record_train(out, name, model, data, loss, opt=adamw(1e-5), bf16=False, keep_loss=True):
    """Trains `model` (moved to the GPU) one step per item of `data` (its shapes may vary), each
    a scope named `train_step`: `loss(model, item)` (under bf16 autocast if `bf16`), its backward
    pass, and a step of the optimizer `opt(params)` makes. With `keep_loss` the loss stays alive
    until the next step's replaces it, as in a training loop that reads it later; else it is
    dropped within its step. Writes `<out>/<name>.csv.gz`."""
    model = model.to(torch.device("cuda")).train()
    opt = opt(model.parameters())
    rec = Recorder("train_step")
    value = None
    with rec:
        for item in data:
            with rec.step():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                    value = loss(model, item)
                value.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if not keep_loss:
                    value = None
        value = None
    return rec.write(os.path.join(out, f"{name}.csv.gz"))


def record_bert_dynpad(out, steps=12, batch=16):
    """BERT-base fine-tuned for classification with dynamic padding: every batch's sequence
    length varies (32 to 256), forward, backward and AdamW each step."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(21)
    lengths = torch.randint(32, 257, (steps,), generator=gen).tolist()
    print(f"bert-dynpad: lengths {lengths}", flush=True)
    data = [
        (
            torch.randint(0, 30522, (batch, n), generator=gen),
            torch.randint(0, 4, (batch,), generator=gen),
        )
        for n in lengths
    ]

    def loss(m, item):
        ids, labels = item
        return m(input_ids=ids.cuda(), labels=labels.cuda()).loss

    model = BertForSequenceClassification(BertConfig(num_labels=4))
    return record_train(out, "bert_dynpad", model, data, loss)


def record_images_train(out, name, model, batches, seed, size=224, classes=1000):
    """`model` trained with SGD (momentum) on random images, `batches[i]` of them in step i."""
    gen = torch.Generator().manual_seed(seed)
    data = [
        (torch.randn(b, 3, size, size, generator=gen), torch.randint(0, classes, (b,)))
        for b in batches
    ]
    lossf = torch.nn.CrossEntropyLoss()

    def loss(m, item):
        x, y = item
        return lossf(m(x.cuda()), y.cuda())

    return record_train(out, name, model, data, loss, sgd(0.01))


def record_batches_train(out, name, make, least, most, seed, steps=12):
    """`make()`'s model trained with SGD on a batch that varies every step (`least` to `most`
    images, drawn with `seed`): the loss of each step is alive when the next begins."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(seed)
    batches = torch.randint(least, most + 1, (steps,), generator=gen).tolist()
    print(f"{name}: batches {batches}", flush=True)
    return record_images_train(out, name, make(), batches, seed + 1)


def record_mobilenet_vary_train(out):
    """torchvision's MobileNetV3-Large trained on 8 to 64 images a step."""
    import torchvision

    make = torchvision.models.mobilenet_v3_large
    return record_batches_train(out, "mobilenet_vary_train", make, 8, 64, 31)


def record_effnet_vary_train(out):
    """torchvision's EfficientNet-B0 trained on 8 to 48 images a step."""
    import torchvision

    make = torchvision.models.efficientnet_b0
    return record_batches_train(out, "effnet_vary_train", make, 8, 48, 42)


def record_swin_vary_train(out):
    """timm's Swin-T trained on 4 to 32 images a step."""
    import timm

    def make():
        return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)

    return record_batches_train(out, "swin_vary_train", make, 4, 32, 44)


def record_resnet_epochs_train(out, epochs=3, batch=48, last=20):
    """torchvision's ResNet-18 trained for a few short epochs without `drop_last`: three full
    batches, then the remainder (a smaller batch), every epoch."""
    import torchvision

    torch.manual_seed(0)
    batches = ([batch] * 3 + [last]) * epochs
    model = torchvision.models.resnet18()
    return record_images_train(out, "resnet_epochs_train", model, batches, 33)


def record_gpt2_vary_train(out, steps=12, batch=8):
    """GPT-2 (6 layers, 512 wide) trained with AdamW on sequences whose length varies every step
    (64 to 512 tokens)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(34)
    lengths = torch.randint(64, 513, (steps,), generator=gen).tolist()
    print(f"gpt2-vary-train: lengths {lengths}", flush=True)
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257)
    data = [torch.randint(0, cfg.vocab_size, (batch, n), generator=gen) for n in lengths]

    def loss(m, ids):
        ids = ids.cuda()
        return m(input_ids=ids, labels=ids).loss

    return record_train(out, "gpt2_vary_train", GPT2LMHeadModel(cfg), data, loss)


def record_swin_infer(out):
    """timm's Swin-T in inference, the batch varying every step (1 to 48 images)."""
    import timm

    def make():
        return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)

    return record_vision_infer(out, "swin_infer", make, 48, 22)


def record_densenet_infer(out):
    import torchvision

    return record_vision_infer(out, "densenet_infer", torchvision.models.densenet121, 64, 23)


def record_detection(out, name, make, seed, steps=10):
    """A torchvision detection model `make()` (random weights) detecting in two images a step,
    each step's images of another size (320 to 800 pixels a side, drawn with `seed`)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = make().to(dev).eval()
    gen = torch.Generator().manual_seed(seed)
    sizes = [tuple(torch.randint(320, 801, (2,), generator=gen).tolist()) for _ in range(steps)]
    print(f"{name}: sizes {sizes}", flush=True)
    rec = Recorder("infer")
    with torch.no_grad(), rec:
        for h, w in sizes:
            with rec.step():
                found = model([torch.rand(3, h, w, device=dev) for _ in range(2)])
                sum(float(d["scores"].sum()) for d in found)
    return rec.write(os.path.join(out, name.replace("-", "_") + ".csv.gz"))


def detection(build):
    """A constructor of torchvision's detection models, with no weights to download."""

    def make():
        import torchvision

        return getattr(torchvision.models.detection, build)(weights=None, weights_backbone=None)

    return make


def record_frcnn_infer(out):
    """torchvision's Faster R-CNN (MobileNetV3 backbone)."""
    return record_detection(out, "frcnn-infer", detection("fasterrcnn_mobilenet_v3_large_fpn"), 24)


def record_detectors(out):
    """Five more of torchvision's detectors (ResNet-50 FPN backbones), recorded as checks of the
    planner on steps that never come again: FCOS, Mask R-CNN, Keypoint R-CNN, Faster R-CNN v2 and
    RetinaNet v2 (each step's images drawn with one seed for all five)."""
    for name, build in [
        ("fcos-infer", "fcos_resnet50_fpn"),
        ("maskrcnn-infer", "maskrcnn_resnet50_fpn"),
        ("keypoint-infer", "keypointrcnn_resnet50_fpn"),
        ("frcnn-v2-infer", "fasterrcnn_resnet50_fpn_v2"),
        ("retinanet-v2-infer", "retinanet_resnet50_fpn_v2"),
    ]:
        record_detection(out, name, detection(build), 31)
        torch.cuda.empty_cache()


def record_deeplab_infer(out, steps=12, batch=4):
    """torchvision's DeepLabV3 (MobileNetV3-Large backbone) segmenting `batch` images a step,
    each step's of another size (256 to 640 pixels a side)."""
    import torchvision

    torch.manual_seed(0)
    dev = torch.device("cuda")
    segmentation = torchvision.models.segmentation
    model = segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, aux_loss=False
    )
    model = model.to(dev).eval()
    gen = torch.Generator().manual_seed(41)
    sizes = [tuple(torch.randint(256, 641, (2,), generator=gen).tolist()) for _ in range(steps)]
    print(f"deeplab-infer: sizes {sizes}", flush=True)

    def run(size):
        h, w = size
        model(torch.randn(batch, 3, h, w, device=dev))["out"].argmax(1).sum().item()

    return record_varying(out, "deeplab_infer", model, sizes, run)


def record_whisper_decode(out, batch=4, tokens=40):
    """A Whisper-style encoder-decoder (4 + 4 layers, 384 wide) in fp16: the encoder over 30 s
    of features (one step), then greedy decoding with `use_cache`, one token a step, the
    encoder's output and the cross-attention's keys and values alive throughout."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = WhisperConfig(
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
    )
    model = WhisperForConditionalGeneration(cfg).to(dev).half().eval()
    features = torch.randn(batch, 80, 3000, device=dev, dtype=torch.half)
    rec = Recorder("decode")
    with torch.no_grad(), rec:
        with rec.step():
            encoded = model.model.encoder(features).last_hidden_state
        start = torch.full((batch, 1), cfg.decoder_start_token_id, device=dev)
        last = decode_greedy(
            rec, model, start, tokens, "decoder_input_ids", encoder_outputs=(encoded,)
        )
        encoded = None
    del last
    return rec.write(os.path.join(out, "whisper_decode.csv.gz"))


def decode_greedy(rec, model, ids, steps, ids_arg="input_ids", **inputs):
    """`steps` steps of `rec`, each a call of `model` with `use_cache` on the last step's token
    (first on `ids`: a prompt, a start token) passed as `ids_arg`, and `inputs`; greedy. The
    keys and values and the last token are let go at the end; the last step's output is
    returned, for the caller to keep until recording ends (as a loop variable of its own
    would)."""
    state = {"past": None, "next": ids}
    o = None
    for _ in range(steps):
        with rec.step():
            o = model(
                **{ids_arg: state["next"]},
                past_key_values=state["past"],
                use_cache=True,
                **inputs,
            )
            state["past"] = o.past_key_values
            state["next"] = o.logits[:, -1:].argmax(-1)
    state.clear()
    return o


def record_mistral_decode(out, batch=8, prompt=128, tokens=64):
    """A Mistral-style decoder (8 layers, 1024 wide, GQA 16/8) in fp16, greedy decoding with
    `use_cache`: the 128-token prompt, then one token a step."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = MistralConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    model = MistralForCausalLM(cfg).to(dev).half().eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=dev)
    rec = Recorder("decode")
    with torch.no_grad(), rec:
        last = decode_greedy(rec, model, ids, tokens + 1)  # the prompt, then one token a step
    del last
    return rec.write(os.path.join(out, "mistral_decode.csv.gz"))


MODELS = {
    "bert-eager-infer": record_bert_eager_infer,
    "gpt2-infer": record_gpt2_infer,
    "resnet18-infer": record_resnet18_infer,
    "vit-infer": record_vit_infer,
    "tiny": record_tiny,
    "vit-train": record_vit_train,
    "llama-serve": record_llama_serve,
    "effnet-infer": record_effnet_infer,
    "opt-serve": record_opt_serve,
    "convnext-infer": record_convnext_infer,
    "gpt2-train": record_gpt2_train,
    "resnet-train": record_resnet_train,
    "bert-infer": record_bert_infer,
    "gpt2-decode": record_gpt2_decode,
    "t5-train": record_t5_train,
    "llama-ckpt-train": record_llama_ckpt_train,
    "bert-dynpad": record_bert_dynpad,
    "swin-infer": record_swin_infer,
    "densenet-infer": record_densenet_infer,
    "frcnn-infer": record_frcnn_infer,
    "detectors": record_detectors,
    "mistral-decode": record_mistral_decode,
    "mobilenet-vary-train": record_mobilenet_vary_train,
    "resnet-epochs-train": record_resnet_epochs_train,
    "gpt2-vary-train": record_gpt2_vary_train,
    "deeplab-infer": record_deeplab_infer,
    "effnet-vary-train": record_effnet_vary_train,
    "swin-vary-train": record_swin_vary_train,
    "whisper-decode": record_whisper_decode,
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--out", default=".", help="directory for <model>.csv.gz")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("record_torch: no CUDA device")
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for m in args.models:
        t = time.time()
        MODELS[m](args.out)
        torch.cuda.empty_cache()
        print(f"{m}: {time.time() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
