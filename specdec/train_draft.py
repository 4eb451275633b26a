"""Train an EAGLE-style draft head (`specdec.models.draft_head`) for a verifier, on this machine.

Two stages (`--stage all` runs both):

data   Run the verifier and record, at every position, its pre-norm last-layer feature f_i (after
       the outputs of --feature-layers, which a fused-feature head also reads), the input token
       x_i and its greedy next token y_i:
       - generation: a greedy and --gen-sampled sampled chat answers to each built-in training
         prompt (`specdec.data.prompts`), produced by our own engine (`SpecEngine`, no draft, many
         prompts batched at once); the prompt positions come for free from the same pass;
       - the same for --written-prompts user turns the verifier writes itself (Magpie), which
         reach the model's own kinds of request: trained on both sets (2.5 million positions),
         the head kept 0.50 of its drafts at K=1 on the bench prompts, against 0.45 for a head
         trained on the built-in set alone (1.4 million);
       - prefill: documentation text already on this machine (package READMEs and docs in
         site-packages, stdlib docstrings), wrapped as an assistant turn; one prefill pass labels
         every position, ~10x cheaper per token than generating.
       Saved as one torch file (`data.pt`) in --data-dir.
train  Fit the head: from (f_i, x_{i+1}) predict f_{i+1} (the first step from the fused features); loss per step = CE of the draft logits vs
       the verifier's greedy label + soft CE vs the verifier's distribution over the draft vocab
       (computed from the stored true f_{i+1}) + smooth-L1 between normed predicted and true
       features. Unrolled --unroll steps, feeding the head its own predicted features (HASS style),
       with the true next tokens. Validation accuracy per step on held-out documents is the
       greedy-acceptance estimate per draft position.

    specdec train-draft                    # the shipped head's recipe (~2 hours on 2 CPU threads)
    specdec train-draft --tiny --out DIR   # seconds, tiny random models (tests)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.models.runner import ModelRunner

DEFAULT_OUT = Path(__file__).resolve().parent / "weights" / "draft_head"


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
class RecordingRunner(ModelRunner):
    """A ModelRunner that keeps every hidden row it computes, per sequence (fp16, CPU). With K=0
    there is nothing to roll back, so each sequence's record is its positions 0..n-1 in order."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records: dict[str, list[tuple[list[int], Tensor]]] = {}

    def forward(self, seq_ids, inputs, trees=None):
        hidden, valid = super().forward(seq_ids, inputs, trees)
        for b, (sid, x) in enumerate(zip(seq_ids, inputs)):
            self.records.setdefault(sid, []).append((list(x), hidden[b, : len(x)].to("cpu", torch.float16)))
        return hidden, valid


def plain_engine(runner: ModelRunner, hf_tok):
    """A draft-free SpecEngine over runner, as many sequences per pass as its slots."""
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.tokenizer import TextTokenizer
    from specdec.verifier import Verifier

    n = runner.max_seqs
    cfg = EngineConfig(num_speculative_tokens=0, adaptive=False, max_seqs=n, max_batch_size=n,
                       max_model_len=runner.max_len, progress=False)
    return SpecEngine(Verifier(runner), None, TextTokenizer(hf_tok), cfg)


def write_prompts(model, hf_tok, n: int, batch: int, max_tokens: int = 96, seed: int = 7_000_000) -> list[dict]:
    """User turns the verifier writes itself (Magpie): its chat template up to where a user's text
    goes, sampled at T=1 until it ends the turn; a turn cut off at max_tokens is dropped, and
    `written_prompts` drops repeats and any close to a benchmark prompt. They take the head into
    the model's own kinds of request, beside the built-in templates'."""
    from specdec.data.prompts import written_prompts
    from specdec.sampling import SamplingParams

    mark = "\x00"
    text = hf_tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    prefix = hf_tok.encode(text[: text.index(mark)], add_special_tokens=False)
    eng = plain_engine(ModelRunner(model, max_seqs=batch, max_len=len(prefix) + max_tokens + 1), hf_tok)
    seqs = [eng.add_request(list(prefix), SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.99, seed=seed + i), 0)
            for i in range(n)]
    while eng.active:
        eng.step()
    return written_prompts([s.text for s in seqs if s.finish_reason == "stop"])  # the engine decoded each turn


def generation_docs(model, hf_tok, prompts: list[dict], max_tokens: int, batch: int, minutes: float,
                    max_len: int, progress: bool = True, temperatures: tuple[float, ...] = (0.0,)) -> list[dict]:
    """Chat answers by the verifier through SpecEngine, one per prompt and temperature (0: greedy;
    a sampled answer's labels are still the verifier's argmax, filled in later); every fed
    position recorded. Sampled answers take the head where greedy ones never go, as a user's
    sampled request does."""
    from tqdm import tqdm

    from specdec.sampling import SamplingParams

    runner = RecordingRunner(model, max_seqs=batch, max_len=max_len, prefix_caching=False)  # record every position
    eng = plain_engine(runner, hf_tok)
    seqs = []
    for temp in temperatures:
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=0.95, seed=round(temp * 1e6) + i)
            try:
                seqs.append((p, eng.add_request(p["messages"], params, 0)))
            except ValueError:  # prompt longer than the context
                continue
    deadline = time.time() + minutes * 60
    bar = tqdm(total=len(seqs) * max_tokens, desc="generate", unit="tok", disable=not progress, mininterval=5)
    done = 0
    while eng.active and time.time() < deadline:
        for s, delta in eng.step():
            bar.update(len(delta.token_ids) + (max_tokens - len(s.output_ids) if s.finished else 0))
            done += s.finished
        bar.set_postfix(done=done, refresh=False)
    bar.close()
    docs = []
    for p, s in seqs:
        rec = runner.records.pop(s.seq_id, None)
        if not rec:
            continue
        toks = [t for x, _ in rec for t in x]
        feats = torch.cat([h for _, h in rec])
        if toks != s.tokens[: len(toks)]:
            raise RuntimeError(f"recorded tokens of {s.seq_id} diverge from the sequence (eviction?)")
        n_prompt = len(s.prompt_ids)
        labels = [s.tokens[i + 1] if s.params.greedy and i >= n_prompt - 1 and i + 1 < len(s.tokens) else -1
                  for i in range(len(toks))]
        docs.append({"tokens": toks, "feats": feats, "labels": torch.tensor(labels), "kind": "gen",
                     "category": p.get("category", ""), "n_prompt": n_prompt, "n_output": len(s.output_ids)})
    del eng, runner
    return docs


def doc_texts(seed: int = 0, max_chars: int = 4000) -> list[tuple[str, str]]:
    """(title, text) pairs from documentation on this machine: READMEs / docs in site-packages and
    stdlib docstrings. Deterministic for a given environment."""
    import site

    from specdec.data.prompts import docstring_passages

    out = []
    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    files = []
    for root in roots:
        for pat in ("*.md", "*.rst", "METADATA"):
            files.extend(root.rglob(pat))
    for f in sorted(set(files)):
        try:
            text = f.read_text(errors="ignore")
        except OSError:
            continue
        if f.name == "METADATA":  # headers, blank line, then the README
            text = text.partition("\n\n")[2]
            title = f.parent.name.split("-")[0]
        else:
            title = f.stem.replace("_", " ")
        if re.search(r"(?i)licen[cs]e|copying|authors|changelog|changes|history", f.name):
            continue
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        for i in range(0, min(len(text), 4 * max_chars), max_chars):  # split long docs
            chunk = text[i : i + max_chars].strip()
            if len(chunk) > 400:
                out.append((title, chunk))
    out += [(p.split("\n")[0][:60], p) for p in docstring_passages(min_chars=400, max_chars=max_chars)]
    random.Random(seed).shuffle(out)
    return out


PREFILL_QUESTIONS = ["Tell me about {t}.", "Can you explain {t}?", "What is {t}?", "Write documentation for {t}.",
                     "Describe {t} in detail.", "Give me an overview of {t}."]


def prefill_docs(model, hf_tok, texts: list[tuple[str, str]], max_tokens: int, minutes: float, doc_tokens: int,
                 chunk: int = 256, seed: int = 0, progress: bool = True) -> list[dict]:
    """Verifier prefill over (title, text) pairs wrapped as chat answers; labels are its argmax."""
    from tqdm import tqdm

    from specdec.tokenizer import TextTokenizer

    tok = TextTokenizer(hf_tok)
    rng = random.Random(seed)
    runner = ModelRunner(model, max_seqs=1, max_len=doc_tokens + 1)
    deadline = time.time() + minutes * 60
    docs, total = [], 0
    bar = tqdm(total=max_tokens, desc="prefill", unit="tok", disable=not progress, mininterval=5)
    for title, text in texts:
        if total >= max_tokens or time.time() >= deadline:
            break
        prompt = tok.chat([{"role": "user", "content": rng.choice(PREFILL_QUESTIONS).format(t=title)}])
        ids = (prompt + tok.encode(text))[:doc_tokens]
        if len(ids) < len(prompt) + 16:
            continue
        runner.free("doc")
        runner.sync(["doc"], [ids + [0]], [0])
        feats, labels = [], []
        for i in range(0, len(ids), chunk):
            h, _ = runner.forward(["doc"], [ids[i : i + chunk]])
            h = h[0]
            labels.append(model.logits(h).argmax(-1).cpu())
            feats.append(h.to("cpu", torch.float16))
        docs.append({"tokens": ids, "feats": torch.cat(feats), "labels": torch.cat(labels), "kind": "prefill",
                     "category": "doc", "n_prompt": len(prompt), "n_output": 0})
        total += len(ids)
        bar.update(len(ids))
    bar.close()
    return docs


@torch.no_grad()
def fill_labels(model, docs: list[dict], rows: int = 1024) -> None:
    """The verifier's argmax wherever a label is missing (prompt positions, a final EOS)."""
    dev, dt = model.embed.weight.device, model.embed.weight.dtype
    for d in docs:
        miss = (d["labels"] < 0).nonzero().flatten()
        for i in range(0, len(miss), rows):
            idx = miss[i : i + rows]
            d["labels"][idx] = model.logits(d["feats"][idx].to(dev, dt)).argmax(-1).cpu()


def pack(docs: list[dict], meta: dict) -> dict:
    """The documents as one set of flat tensors. Each document's features move into the packed
    tensor one at a time, so they never exist twice: packing 2.25 million positions (7.8 GB of
    features) with torch.cat ran this 24 GB machine out of memory."""
    starts, n = [], 0
    for d in docs:
        starts.append(n)
        n += len(d["tokens"])
    feats = torch.empty(n, docs[0]["feats"].shape[1] if docs else 0, dtype=torch.float16)
    for s, d in zip(starts, docs):
        f = d.pop("feats")
        feats[s : s + len(f)] = f
    return {
        "tokens": torch.tensor([t for d in docs for t in d["tokens"]], dtype=torch.int64),
        "labels": torch.cat([d["labels"] for d in docs]).long(),
        "feats": feats,
        "doc_start": torch.tensor(starts + [n], dtype=torch.int64),
        "doc_kind": [d["kind"] for d in docs],
        "doc_category": [d["category"] for d in docs],
        "doc_n_prompt": [d["n_prompt"] for d in docs],
        "meta": meta,
    }


def make_data(args, model, hf_tok) -> dict:
    from specdec.data.prompts import training_prompts

    def answer(prompts: list[dict]) -> list[dict]:  # a greedy and --gen-sampled sampled answers each
        temps = (0.0,) + (args.gen_temperature,) * args.gen_sampled
        return generation_docs(model, hf_tok, prompts, args.gen_max_tokens, args.gen_batch, args.gen_minutes,
                               args.max_len, not args.quiet, temps) if prompts else []

    t0 = time.time()
    docs = answer(training_prompts(args.gen_prompts, seed=args.seed, docstrings=not args.tiny) if args.gen_prompts > 0 else [])
    t_gen = time.time() - t0
    t0 = time.time()
    written = write_prompts(model, hf_tok, args.written_prompts, args.gen_batch, seed=7_000_000 + 100_000 * args.seed) \
        if args.written_prompts > 0 else []
    t_write = time.time() - t0
    t0 = time.time()
    docs += answer(written)
    t_written = time.time() - t0
    t1 = time.time()
    if args.prefill_tokens > 0:
        texts = doc_texts(args.seed) if not args.tiny else [("tiny", "The quick brown fox jumps over the lazy dog. " * 8)] * 2
        docs += prefill_docs(model, hf_tok, texts, args.prefill_tokens, args.prefill_minutes, args.prefill_doc_tokens,
                             seed=args.seed, progress=not args.quiet)
    t_prefill = time.time() - t1
    t2 = time.time()
    fill_labels(model, docs)
    gen = [d for d in docs if d["kind"] == "gen"]
    meta = {
        "verifier": args.verifier, "feature_layers": list(args.feature_layers),
        "gen_docs": len(gen), "gen_output_tokens": sum(d["n_output"] for d in gen),
        "gen_prompt_tokens": sum(d["n_prompt"] for d in gen), "written_prompts": len(written),
        "written_docs": sum(d["category"] == "written" for d in gen),
        "prefill_docs": len(docs) - len(gen),
        "prefill_tokens": sum(len(d["tokens"]) for d in docs if d["kind"] == "prefill"),
        "positions": sum(len(d["tokens"]) for d in docs),
        "seconds_generate": round(t_gen, 1), "seconds_write": round(t_write, 1),
        "seconds_generate_written": round(t_written, 1), "seconds_prefill": round(t_prefill, 1),
        "seconds_labels": round(time.time() - t2, 1),
    }
    data = pack(docs, meta)
    # a chunk at a time: a float32 copy of all the features would be twice their size again
    meta["feature_max_abs"] = max((float(c.abs().max()) for c in data["feats"].split(1 << 16)), default=0.0)
    return data


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def choose_vocab(labels: Tensor, size: int, vocab_size: int, forced: list[int], within: Tensor | None = None) -> Tensor:
    """The `size` most frequent verifier labels (forced ids first), sorted by id; only ids of
    `within` where given."""
    counts = torch.bincount(labels.clamp_min(0), minlength=vocab_size).float()
    counts[forced] = float("inf")
    if within is not None:
        keep = torch.full_like(counts, -1.0)
        keep[within] = counts[within]
        counts = keep
    size = min(size, vocab_size if within is None else len(within))
    return counts.topk(size).indices.sort().values


def draft_index(vocab_ids: Tensor, vocab_size: int) -> Tensor:
    """[vocab_size]: each verifier token's index in the draft vocabulary, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


class Batches:
    """Samples start positions i such that i+1..i+U lie in the same document."""

    def __init__(self, data: dict, unroll: int, val_frac: float, seed: int):
        self.data, self.U = data, unroll
        starts = data["doc_start"]
        D = len(starts) - 1
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(D, generator=g)
        n_val = max(1, int(round(D * val_frac))) if D > 1 else 0
        val_docs = set(perm[:n_val].tolist())
        train_idx, val_idx, val_gen_idx = [], [], []
        for d in range(D):
            s, e = int(starts[d]), int(starts[d + 1])
            if e - s <= unroll:
                continue
            idx = torch.arange(s, e - unroll)
            if d in val_docs:
                val_idx.append(idx)
                if data["doc_kind"][d] == "gen":  # the answer region: what drafting sees
                    val_gen_idx.append(idx[idx >= s + data["doc_n_prompt"][d] - 1])
            else:
                train_idx.append(idx)
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
        self.train, self.val, self.val_gen = cat(train_idx), cat(val_idx), cat(val_gen_idx)
        if len(self.train) == 0:
            raise ValueError("no training positions: make more data or lower --unroll")
        self.g = g

    def sample(self, n: int) -> Tensor:
        return self.train[torch.randint(len(self.train), (n,), generator=self.g)]


def unit(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def unrolled_loss(head, data: dict, idx: Tensor, label_map: Tensor, args, train: bool = True):
    """Loss and per-step accuracy over start positions idx, unrolled args.unroll steps."""
    feats, tokens, labels = data["feats"], data["tokens"], data["labels"]
    dev = head.embed_weight.device  # the data stays where it was collected; each batch moves to the head
    dim = head.cfg.dim
    f = feats[idx].to(dev).float()  # the verifier's fused features when the head reads several layers
    if head.fuse is None:
        f = f[..., -dim:]
    total, accs = 0.0, []
    w = 1.0
    wsum = 0.0
    for j in range(1, args.unroll + 1):
        pos = idx + j
        f = head(f, tokens[pos].to(dev))
        logits = head.draft_logits(f)
        true_f = feats[pos, -dim:].to(dev).float()  # the last layer's: what the LM head reads
        with torch.no_grad():
            teacher = F.softmax(head.draft_logits(true_f), dim=-1)
        lab = label_map[labels[pos]].to(dev)  # draft-vocab index, -1 outside
        lp = F.log_softmax(logits, dim=-1)
        hard = F.nll_loss(lp, lab, ignore_index=-1) if (lab >= 0).any() else lp.sum() * 0
        soft = -(teacher * lp).sum(-1).mean()
        reg = F.smooth_l1_loss(unit(f, head.norm_weight, head.verifier_eps),
                               unit(true_f, head.norm_weight, head.verifier_eps))
        total = total + w * (args.ce_weight * hard + args.kd_weight * soft + args.reg_weight * reg)
        wsum += w
        w *= args.step_decay
        accs.append(float((head.vocab_ids[logits.argmax(-1)] == labels[pos].to(dev)).float().mean()))
        if not train:
            f = f.detach()
    return total / wsum, accs


@torch.no_grad()
def evaluate(head, data, idx: Tensor, label_map, args, rows: int = 1024) -> tuple[float, list[float]]:
    if len(idx) == 0:
        return float("nan"), []
    loss, accs, n = 0.0, [0.0] * args.unroll, 0
    for i in range(0, len(idx), rows):
        b = idx[i : i + rows]
        l, a = unrolled_loss(head, data, b, label_map, args, train=False)
        loss += float(l) * len(b)
        accs = [x + y * len(b) for x, y in zip(accs, a)]
        n += len(b)
    return loss / n, [round(a / n, 4) for a in accs]


INFO_ARGS = ("gen_prompts", "gen_max_tokens", "gen_sampled", "gen_temperature", "gen_minutes", "written_prompts", "prefill_tokens", "data_dtype", "draft_vocab", "keep_vocab", "hidden", "blocks", "steps",
             "train_minutes", "batch_size", "unroll", "lr", "ce_weight", "kd_weight", "reg_weight", "seed")


def train(args, model, data: dict, hf_tok=None):
    from tqdm import tqdm

    from specdec.models.draft_head import DraftHead, DraftHeadConfig

    torch.manual_seed(args.seed)
    a = model.args
    forced = sorted({i for i in [getattr(hf_tok, "eos_token_id", None)] if isinstance(i, int)})
    vocab_ids = choose_vocab(data["labels"], args.draft_vocab, a.vocab_size, forced)
    cover = float(torch.isin(data["labels"], vocab_ids).float().mean())
    cfg = DraftHeadConfig(dim=a.dim, hidden_size=args.hidden, n_blocks=args.blocks, draft_vocab_size=len(vocab_ids),
                          vocab_size=a.vocab_size, verifier=args.verifier, feature_layers=list(args.feature_layers))
    head = DraftHead(cfg, vocab_ids).attach(model).float()
    head.train()
    label_map = draft_index(vocab_ids, a.vocab_size)
    batches = Batches(data, args.unroll, args.val_frac, args.seed)
    val_idx = batches.val[torch.randperm(len(batches.val), generator=torch.Generator().manual_seed(1))[: args.val_rows]]
    val_gen = batches.val_gen[torch.randperm(len(batches.val_gen), generator=torch.Generator().manual_seed(2))[: args.val_rows]]
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    log = {"data": data.get("meta", {}), "args": {k: getattr(args, k) for k in INFO_ARGS},
           "draft_vocab_coverage": round(cover, 4), "trained_params": head.num_trained_params(),
           "train_positions": len(batches.train), "val_positions": len(batches.val), "evals": []}
    print(f"draft head: {head.num_trained_params() / 1e6:.2f} M trained params, draft vocab {len(vocab_ids)} "
          f"(covers {cover:.1%} of labels), {len(batches.train)} train / {len(batches.val)} val positions", flush=True)
    t0 = time.time()
    limit = args.train_minutes * 60 if args.train_minutes > 0 else float("inf")
    bar = tqdm(total=args.steps, desc="train", disable=args.quiet, mininterval=5)
    ema, ema_acc, step = None, None, 0
    while True:
        progress = max(step / args.steps, (time.time() - t0) / limit)
        if progress >= 1.0:
            break
        # linear warmup, then cosine to 10 % of the peak; progress counts steps or time, whichever is further
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, accs = unrolled_loss(head, data, batches.sample(args.batch_size), label_map, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        ema_acc = accs if ema_acc is None else [0.98 * x + 0.02 * y for x, y in zip(ema_acc, accs)]
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", acc="/".join(f"{x:.2f}" for x in ema_acc), lr=f"{lr:.1e}", refresh=False)
        if step % args.eval_every == 0:
            _eval_and_save(head, data, val_idx, val_gen, label_map, args, log, step, ema, t0)
    bar.close()
    if args.keep_vocab < len(vocab_ids):  # the saved head drafts from the most frequent of its tokens
        head.keep_vocab(choose_vocab(data["labels"], args.keep_vocab, a.vocab_size, forced, within=vocab_ids))
        label_map = draft_index(head.vocab_ids.cpu(), a.vocab_size)
        log["kept_vocab_coverage"] = round(float(torch.isin(data["labels"], head.vocab_ids.cpu()).float().mean()), 4)
    _eval_and_save(head, data, val_idx, val_gen, label_map, args, log, step, ema, t0)
    return head, log


def _eval_and_save(head, data, val_idx, val_gen, label_map, args, log, step, ema, t0):
    head.eval()
    vl, va = evaluate(head, data, val_idx, label_map, args)
    gl, ga = evaluate(head, data, val_gen, label_map, args)
    head.train()
    e = {"step": step, "seconds": round(time.time() - t0, 1), "train_loss_ema": round(ema or 0.0, 4),
         "val_loss": round(vl, 4), "val_acc_per_step": va, "val_gen_loss": round(gl, 4), "val_gen_acc_per_step": ga}
    log["evals"].append(e)
    print(json.dumps(e), flush=True)
    head.cfg.train_info = {**{k: v for k, v in log.items() if k != "evals"}, "steps": step, "last_eval": e}
    head.save(args.out)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="specdec train-draft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", default="default", help="verifier spec ('default', an HF dir, 'tiny')")
    p.add_argument("--out", default=None, help=f"where the trained head goes (default {DEFAULT_OUT})")
    p.add_argument("--data-dir", default=None, help="where data.pt is written / read "
                   "(default $SPECDEC_HOME/draft_data/<verifier>)")
    p.add_argument("--stage", choices=["all", "data", "train"], default="all")
    p.add_argument("--tiny", action="store_true", help="tiny random models, seconds end to end (tests)")
    g = p.add_argument_group("data")
    g.add_argument("--gen-prompts", type=int, default=2000, help="training prompts answered by the verifier (at most the ~1960 built in)")
    g.add_argument("--gen-max-tokens", type=int, default=256, help="new tokens per answer at most")
    g.add_argument("--gen-sampled", type=int, default=1, help="sampled answers per prompt besides the greedy one")
    g.add_argument("--gen-temperature", type=float, default=0.8, help="temperature of the sampled answers (top-p 0.95)")
    g.add_argument("--gen-batch", type=int, default=64, help="sequences per verifier pass while generating")
    g.add_argument("--gen-minutes", type=float, default=22.0, help="stop answering a prompt set (built-in, written) after this long")
    g.add_argument("--written-prompts", type=int, default=3600,
                   help="user turns the verifier writes itself (Magpie) and then answers as the built-in ones; those "
                        "cut off, repeated or close to a benchmark prompt are dropped (~2800 kept)")
    g.add_argument("--prefill-tokens", type=int, default=400_000, help="documentation tokens to label by prefill")
    g.add_argument("--prefill-minutes", type=float, default=6.0, help="stop prefilling after this long")
    g.add_argument("--prefill-doc-tokens", type=int, default=768, help="tokens per prefilled document at most")
    g.add_argument("--max-len", type=int, default=1024, help="context window while making data")
    g.add_argument("--data-dtype", default="auto", help="the verifier's dtype while making data: the features "
                   "and labels the head learns are those of the verifier it will serve ('auto', as served)")
    g = p.add_argument_group("model")
    g.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size in training")
    g.add_argument("--keep-vocab", type=int, default=4096,
                   help="draft vocabulary the saved head keeps: the most frequent of the trained one (a drafting "
                        "step reads one LM-head row per token: 4096 of 8192 ran greedy ~1%% and sampled ~2%% faster at "
                        "the same tokens per pass)")
    g.add_argument("--hidden", type=int, default=1536, help="SwiGLU width of each block")
    g.add_argument("--blocks", type=int, default=2, help="residual blocks")
    g.add_argument("--feature-layers", default="auto", help="verifier layers (0-based, comma separated) whose outputs the "
                   "first step reads besides the last layer's: 'auto' a low and a middle one (EAGLE-3), 'none' the last only")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=100_000, help="optimizer steps at most")
    g.add_argument("--train-minutes", type=float, default=50.0, help="stop (cosine schedule ends) after this long; 0 = no limit")
    g.add_argument("--batch-size", type=int, default=256, help="start positions per step")
    g.add_argument("--unroll", type=int, default=4, help="chained steps per sample (head runs on its own features)")
    g.add_argument("--lr", type=float, default=1.5e-3)
    g.add_argument("--warmup", type=int, default=200)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--ce-weight", type=float, default=0.5, help="CE vs the verifier's greedy label")
    g.add_argument("--kd-weight", type=float, default=0.5, help="soft CE vs the verifier's draft-vocab distribution")
    g.add_argument("--reg-weight", type=float, default=1.0, help="smooth-L1 on normed features")
    g.add_argument("--step-decay", type=float, default=0.8, help="loss weight ratio between consecutive unrolled steps")
    g.add_argument("--val-frac", type=float, default=0.04, help="documents held out for validation")
    g.add_argument("--val-rows", type=int, default=4096, help="validation positions evaluated")
    g.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    return shrink_for_tiny(args) if args.tiny else args


def shrink_for_tiny(args: argparse.Namespace) -> argparse.Namespace:
    """--tiny: the recipe cut to seconds on tiny random models (tests)."""
    if args.verifier == "default":
        args.verifier = "tiny"
    args.gen_prompts, args.gen_max_tokens, args.gen_batch = min(args.gen_prompts, 6), min(args.gen_max_tokens, 12), 6
    args.written_prompts = min(args.written_prompts, 4)
    args.prefill_tokens, args.prefill_doc_tokens, args.max_len = min(args.prefill_tokens, 300), 150, 512
    args.draft_vocab, args.hidden, args.blocks = min(args.draft_vocab, 128), min(args.hidden, 64), min(args.blocks, 1)
    args.keep_vocab = min(args.keep_vocab, 96)
    args.steps, args.batch_size, args.eval_every, args.warmup = min(args.steps, 8), min(args.batch_size, 16), 10**9, 2
    args.val_rows = min(args.val_rows, 64)
    if args.out is None:
        raise SystemExit("--tiny needs --out (it must not overwrite the shipped head)")
    return args


def feature_layers(spec: str, n_layers: int) -> tuple[int, ...]:
    """--feature-layers as layer indices: 'auto' is the outputs of layers 2 and n/2 (the inputs
    of the third and the middle one, as EAGLE-3 reads them), 'none' no layer."""
    if spec == "none":
        return ()
    if spec == "auto":
        return tuple(sorted({min(1, n_layers - 2), max(0, n_layers // 2 - 1)})) if n_layers >= 2 else ()
    return tuple(int(x) for x in spec.split(","))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(max(1, args.threads))
    from specdec.models.default import specdec_home
    from specdec.models.loader import load_model, load_tokenizer

    args.out = Path(args.out or DEFAULT_OUT)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", args.verifier)
    data_dir = Path(args.data_dir) if args.data_dir else specdec_home() / "draft_data" / name
    data_path = data_dir / "data.pt"
    hf_tok = load_tokenizer(args.verifier, progress=not args.quiet)
    if args.stage in ("all", "data"):
        served = load_model(args.verifier, dtype=args.data_dtype, progress=not args.quiet).requires_grad_(False)
        args.feature_layers = feature_layers(args.feature_layers, served.args.n_layers)
        served.feature_layers = args.feature_layers  # recorded with the last layer's feature
        data = make_data(args, served, hf_tok)
        del served
        data_dir.mkdir(parents=True, exist_ok=True)
        torch.save(data, data_path)
        print(f"data: {json.dumps(data['meta'])} -> {data_path}", flush=True)
        if args.stage == "data":
            return 0
    else:
        data = torch.load(data_path, weights_only=False, mmap=True)  # read from the page cache, not copied
        print(f"data: {json.dumps(data['meta'])}", flush=True)
    # training differentiates through the verifier's frozen embedding, norm and LM head: in float32
    model = load_model(args.verifier, progress=not args.quiet).requires_grad_(False)
    if isinstance(args.feature_layers, str):  # not resolved by a data stage in this run
        args.feature_layers = feature_layers(args.feature_layers, model.args.n_layers)
    recorded = tuple(data["meta"].get("feature_layers", ()))
    if args.feature_layers and args.feature_layers != recorded:
        raise SystemExit(f"the head would read layers {args.feature_layers}; the data has {recorded} (make it again)")
    t0 = time.time()
    train(args, model, data, hf_tok)
    print(f"trained in {time.time() - t0:.0f} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
