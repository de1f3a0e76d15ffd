"""Run in the vLLM interpreter (.venv-vllm) by test_vllm_exports.py: load each export with vLLM's own
offline engine and print the greedy tokens it generates for each prompt, as JSON on the last line.

    .venv-vllm/bin/python tests/pipeline/serving/vllm_greedy.py SPEC.json
SPEC: [{"dir": ..., "prompts": [[ids], ...], "max_tokens": N}, ...]; the output: one list of token-id
lists per entry, or {"error": "..."} where vLLM refused the export.
"""

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # every entry generates exactly max_tokens (Conduit's reference does not stop at an EOS either)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for entry in json.load(open(sys.argv[1])):
        llm = LLM(model=entry["dir"], dtype="float32", enforce_eager=True, max_model_len=entry["max_model_len"],
                  max_num_seqs=4, seed=0, skip_tokenizer_init=True)  # token ids in and out
        params = SamplingParams(temperature=0.0, max_tokens=entry["max_tokens"], ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in entry["prompts"]], params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outs])
        del llm
    print(json.dumps(results))


if __name__ == "__main__":  # vLLM's engine runs in a spawned process
    main()
