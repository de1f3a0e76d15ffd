"""pipeline.evaluation on a tiny model and a tokenizer trained here: exact byte accounting, windows,
LAMBADA scoring against real greedy decoding, word-order shuffling, MoE routing stats and the plots."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from models import build_model
from models.generate import generate
from models.layers.loss import lm_loss
from pipeline.evaluation import lambada, plots, references, routing, text_metrics, word_order
from pipeline.tokenization.spm import EOS_ID, load_sentencepiece, train_sentencepiece, training_lines


@pytest.fixture(scope="module")
def sp(tmp_path_factory, data_root):
    text = (data_root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:200_000]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(train_sentencepiece(training_lines(text.split("\n\n"), 10**9), vocab_size=512, model_type="bpe",
                                         character_coverage=1.0, byte_fallback=True, normalization="identity",
                                         num_threads=1))
    return load_sentencepiece(str(path))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("debug_dense", vocab_size=512, max_seq_len=64).eval()


def test_encode_prefix_counts_exactly_the_bytes_it_scores(sp, data_root):
    text = (data_root / "gutenberg" / "heldout" / "pg00046_a_christmas_carol.txt").read_text(encoding="utf-8")
    for budget in (1, 7, 300, 1001):
        ids, prefix = text_metrics.encode_prefix(sp, text, budget)
        assert 0 < len(ids) <= budget and text.startswith(prefix) and sp.decode(ids) == prefix
    # Curly quotes are byte-fallback pieces for a Shakespeare tokenizer: a cut inside one drops its bytes.
    quote = "\u201cHe said so\u201d " * 50
    for budget in range(1, 12):
        ids, prefix = text_metrics.encode_prefix(sp, quote, budget)
        assert quote.startswith(prefix) and "\ufffd" not in prefix
    files = text_metrics.resolve_files(data_root, ["gutenberg/heldout/*.txt"], "eval.heldout_paths")
    enc = text_metrics.encode_files(sp, files, 1000)
    assert len(enc.ids) == 5 and enc.n_targets == 5 * 200 and all(d[0] == EOS_ID for d in enc.ids)
    with pytest.raises(FileNotFoundError, match="eval.heldout_paths: 'nothing/\\*.txt' matches no file"):
        text_metrics.resolve_files(data_root, ["nothing/*.txt"], "eval.heldout_paths")
    # A shipped corpus missing from the data root says how to get it: `make data` rebuilds the books from the
    # public raw e-books.
    with pytest.raises(FileNotFoundError, match=r"the data root is .*/empty \(set it with data.data_root or "
                                                r"\$CONDUIT_DATA_ROOT.*'gutenberg-heldout'.*`make data` fetches it from its public source"):
        text_metrics.resolve_files(data_root / "empty", ["gutenberg/heldout/*.txt"], "eval.heldout_paths")


def test_windows_score_every_token_once_and_metrics_match_a_direct_loss(model):
    docs = [[EOS_ID, *range(10, 40)], [EOS_ID, *range(50, 55)]]
    inputs, targets = text_metrics.windows(docs, context=8)
    scored = targets[targets != text_metrics.IGNORE].tolist()
    assert scored == [*range(10, 40), *range(50, 55)]
    assert inputs.shape == targets.shape == (4 + 1, 8)
    doc = [EOS_ID, *range(10, 60)]
    enc = text_metrics.EncodedText([doc], n_bytes=100, n_words=20)
    m = text_metrics.text_metrics(model, enc, context=64, batch_size=2)
    with torch.no_grad():
        direct = lm_loss(model(torch.tensor([doc[:-1]])).logits, torch.tensor([doc[1:]])).item()
    assert m["loss"] == pytest.approx(direct, rel=1e-5) and m["tokens"] == 50
    assert m["bits_per_byte"] == pytest.approx(direct * 50 / math.log(2) / 100, rel=1e-5)
    assert m["word_perplexity"] == pytest.approx(math.exp(direct * 50 / 20), rel=1e-4)


def test_lambada_accuracy_agrees_with_greedy_decoding(model, sp, data_root):
    context = [EOS_ID, *sp.encode("Now is the winter of our discontent made glorious")]
    greedy = generate(model, torch.tensor([context]), max_new_tokens=3, temperature=0.0)[0, len(context):].tolist()
    wrong = [greedy[0], greedy[1], (greedy[2] + 1) % 512]
    examples = [lambada.Example(context, greedy), lambada.Example(context, greedy[:1]), lambada.Example(context, wrong)]
    m = lambada.lambada_metrics(model, examples, context=64, batch_size=2)
    assert m["accuracy"] == pytest.approx(2 / 3) and m["examples"] == 3 and m["perplexity"] > 1
    hit, nll = lambada.score_targets(torch.tensor([[0.0, 5.0], [3.0, 0.0]]), [1, 0])
    assert hit and nll == pytest.approx(math.log1p(math.exp(-5)) + math.log1p(math.exp(-3)), rel=1e-5)
    loaded = lambada.load_examples(data_root / "lambada" / "lambada_openai_test.jsonl", sp, 5)
    assert len(loaded) == 5 and sp.decode(loaded[0].target_ids) == "signs"
    assert loaded[0].context_ids[0] == EOS_ID


def test_shuffling_keeps_each_rows_tokens(model):
    blocks = np.arange(40).reshape(4, 10) % 512
    shuffled = word_order.shuffle_within_rows(blocks, seed=1)
    assert (np.sort(shuffled, axis=1) == np.sort(blocks, axis=1)).all() and (shuffled != blocks).any()
    m = word_order.word_order_metrics(model, blocks, batch_size=2, seed=1)
    assert m["word_order_gap"] == pytest.approx(m["shuffled_loss"] - m["word_order_loss"])


def test_routing_stats_and_expert_load_plot():
    torch.manual_seed(0)
    moe = build_model("debug_moe", vocab_size=512, max_seq_len=64).eval()
    blocks = np.random.default_rng(0).integers(5, 512, (6, 33))
    stats = routing.routing_stats(moe, blocks, batch_size=4)
    assert stats["load_share"].shape == (2, 4) and np.allclose(stats["load_share"].sum(axis=1), 1.0)
    assert ((0 < stats["router_entropy"]) & (stats["router_entropy"] <= math.log(4) + 1e-6)).all()
    m = routing.routing_metrics(stats)
    assert {"router_entropy", "router_entropy_layer1", "expert_load_max_over_uniform_layer0"} <= set(m)
    fig = plots.expert_load_figure(stats["load_share"], stats["router_entropy"])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"
    assert "score_bias" not in stats and not any(k.startswith("score_bias") for k in m)
    with pytest.raises(ValueError, match="needs an MoE model"):
        routing.routing_stats(build_model("debug_dense", vocab_size=512), blocks, batch_size=4)


def test_a_sigmoid_routers_bias_is_in_the_stats_and_beside_the_load_picture():
    moe = build_model("debug_moe", vocab_size=512, max_seq_len=64, moe_router="sigmoid").eval()
    bias = torch.tensor([[0.25, -0.5, 0.0, 0.125], [0.0, 0.0, 0.0, 0.0]])
    layers = [b.ffn for b in moe.layers if b.is_moe]
    for layer, row in zip(layers, bias, strict=True):
        layer.score_bias.copy_(row)
    blocks = np.random.default_rng(0).integers(5, 512, (6, 33))
    stats = routing.routing_stats(moe, blocks, batch_size=4)
    np.testing.assert_array_equal(stats["score_bias"], bias.double().numpy())
    m = routing.routing_metrics(stats)
    assert (m["score_bias_range_layer0"], m["score_bias_range_layer1"]) == (0.75, 0.0)
    fig = plots.expert_load_figure(stats["load_share"], stats["router_entropy"], stats["score_bias"])
    assert len(fig.axes) == 4  # two heatmaps, each with its colour bar
    assert "selection bias" in fig.axes[1].get_title()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_attention_grid_has_a_panel_per_layer_and_head(model, sp):
    weights, labels = plots.attention_maps(model, sp, "To be, or not to be")
    L, H, T, S = weights.shape
    assert (L, H) == (2, 4) and T == S == len(labels) and labels[0] == "</s>"
    assert np.allclose(weights.sum(-1), 1.0, atol=1e-5) and np.allclose(np.triu(weights, 1), 0.0)
    fig = plots.attention_figure(weights, labels)
    assert len(fig.axes) == L * H
    with pytest.raises(ValueError, match="eval.attention_sentence=''"):
        plots.attention_maps(model, sp, "")


def test_reference_table_lists_only_what_we_measured():
    table = references.reference_table({"lambada_accuracy": 0.01, "val_loss": 3.0})
    assert table["metric"] == ["lambada_accuracy"] and table["gpt2_117m"] == [0.4599]
    assert "lambada_accuracy" in references.format_table(table)


def test_evaluation_device_precision_and_resources(model):
    from pipeline.config import load_config
    from pipeline.evaluation.device import autocast, eval_device, eval_precision
    from pipeline.stages.evaluate import resources_on
    from pipeline.stages.stage import Resources

    # Where the evaluate task runs: a GPU when the cluster has one, else eval.cpus CPUs.
    cfg = load_config(None, ["eval.cpus=2"])
    assert resources_on(cfg, 0) == Resources(cpus=2) and resources_on(cfg, 8) == Resources(cpus=1, gpus=1)
    assert resources_on(load_config(None, ["eval.device=cpu"]), 8) == Resources(cpus=1)
    with pytest.raises(ValueError, match=r"eval.device=cuda but no GPU is visible in the Ray cluster"):
        resources_on(load_config(None, ["eval.device=cuda"]), 0)
    assert eval_device("auto", 0) == "cpu" and eval_precision("auto", "cpu") == "fp32"
    assert eval_precision("auto", "cuda") == "bf16" and eval_precision("fp32", "cuda") == "fp32"
    # fp32 on CPU scores as before (no autocast); bf16 autocast changes the logits but not by much.
    blocks = np.random.default_rng(0).integers(5, 512, size=(4, 33))
    x, y = torch.from_numpy(blocks[:, :-1]), torch.from_numpy(blocks[:, 1:])
    with torch.no_grad():
        direct = lm_loss(model(x).logits, y).item() * y.numel()
        with autocast("cpu", "fp32"):
            plain, _ = text_metrics.summed_nll(model, blocks[:, :-1], blocks[:, 1:], batch_size=3)
        with autocast("cpu", "bf16"):
            low, _ = text_metrics.summed_nll(model, blocks[:, :-1], blocks[:, 1:], batch_size=3)
    assert plain == pytest.approx(direct, rel=1e-6)
    assert low != plain and low == pytest.approx(plain, rel=2e-2)


def test_context_lengths_score_the_same_text_and_positions_add_up(model, sp, data_root):
    from pipeline.evaluation import context_length

    files = text_metrics.resolve_files(data_root, ["gutenberg/heldout/*.txt"], "eval.heldout_paths")
    encoded = text_metrics.encode_files(sp, files, 2048)
    m = context_length.context_metrics(model, encoded, [16, 32, 64], batch_size=4)
    # one length is the stage's usual window: the same windows, the same number
    direct = text_metrics.text_metrics(model, encoded, 32, batch_size=4)
    assert m["context_bits_per_byte_32"] == pytest.approx(direct["bits_per_byte"], rel=1e-12)
    assert m["context_loss_32"] == pytest.approx(direct["loss"], rel=1e-12)
    # every length scores every byte: bits per byte = loss x tokens / bytes, the same tokens each time
    for L in (16, 32, 64):
        assert m[f"context_bits_per_byte_{L}"] == pytest.approx(
            m[f"context_loss_{L}"] * direct["tokens"] / math.log(2) / encoded.n_bytes, rel=1e-9)
        assert m[f"kv_cache_bytes_{L}"] == 2 * 2 * model.cfg.n_layers * model.cfg.d_model * L  # bf16 k and v
    # the position buckets of the longest window, weighted by their targets, give back its loss
    nll_L, count_L = context_length.loss_by_position(model, *text_metrics.windows(encoded.ids, 64), 4)
    assert nll_L.sum() / count_L.sum() == pytest.approx(m["context_loss_64"], rel=1e-5)
    buckets = context_length.position_buckets(64)
    assert buckets == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
    for lo, hi in buckets:
        assert m[f"context_loss_pos_{lo}_{hi}"] == pytest.approx(nll_L[lo:hi].sum() / count_L[lo:hi].sum(), rel=1e-9)
    fig = context_length.context_figure(m, trained_length=32)
    fig.savefig(io.BytesIO(), format="png")
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match=r"eval.context_lengths \[128\] exceed the model's max_seq_len=64"):
        context_length.context_metrics(model, encoded, [32, 128], batch_size=4)
