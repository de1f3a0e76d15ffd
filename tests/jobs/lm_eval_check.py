"""Evaluated as deployed: lm-evaluation-harness scores a deployment exactly as it scores the export."""

from __future__ import annotations

from pathlib import Path

from pipeline import tracking


def assert_scored_as_hf_export(base_url: str, uri: str, model_name: str, version: int, tmp_path: Path) -> None:
    """lm-evaluation-harness's local-completions model against the deployment at ``base_url`` (the
    registered version's HF tokenizer as the harness's) and its hf model on the same version's HF export,
    one small local perplexity task: every document's log-likelihood agrees to 1e-4 per token (float32)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from pipeline.evaluation.lm_eval_task import write_rolling_task
    from pipeline.store.contracts import HF_DIR
    from pipeline.tokenization.spm import EOS_ID

    local = tracking.download_model(uri, f"models:/{model_name}/{version}", tmp_path / f"v{version}")
    hf_dir = str(local / "artifacts" / HF_DIR)
    texts = ["KING: What is the matter, my lord?\nQUEEN: Nothing.", "First Citizen:\nBefore we proceed any further, "
             "hear me speak.\n\nAll: Speak, speak.", "O Romeo, Romeo! wherefore art thou Romeo?"]
    write_rolling_task(tmp_path / "tasks", "conduit_served", texts)
    # hf's rolling windows predict max_length tokens; the API model's predict max_length - 2 (it keeps one
    # slot for the answered token, and one more for the window's context token), so the same windows:
    window = 48
    common = dict(tasks=["conduit_served"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
                  log_samples=True, batch_size=1, device="cpu")
    served_run = lm_eval.simple_evaluate(
        model="local-completions", model_args={
            "base_url": f"{base_url}/completions", "model": model_name, "tokenizer": hf_dir,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": window + 2,
            "custom_prefix_token_id": EOS_ID, "num_concurrent": 1, "max_retries": 1}, **common)
    hf_run = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": hf_dir, "dtype": "float32", "max_length": window,
                                "prefix_token_id": EOS_ID}, **common)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    served_docs = sorted(served_run["samples"]["conduit_served"], key=lambda d: d["doc_id"])
    hf_docs = sorted(hf_run["samples"]["conduit_served"], key=lambda d: d["doc_id"])
    assert len(served_docs) == len(hf_docs) == len(texts)
    for a, b, text in zip(served_docs, hf_docs, texts):
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        ll_served, ll_hf = a["filtered_resps"][0], b["filtered_resps"][0]
        assert ll_served < 0 and abs(ll_served - ll_hf) <= 1e-4 * n, (ll_served, ll_hf, n)
