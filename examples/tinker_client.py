"""A plain `tinker` SDK client for `rollwise serve tinker`: LoRA SFT steps, a checkpoint, then samples from the
trained weights. Nothing rollwise-specific: the same script runs against any Tinker-compatible server.

    rollwise serve tinker --port 8400 --api-keys keys.txt --base-model tiny:0 &
    TINKER_API_KEY=$(head -1 keys.txt) python examples/tinker_client.py --base-url http://127.0.0.1:8400 --base-model tiny:0
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8400")
    p.add_argument("--base-model", default="bundled:smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url)  # the key comes from TINKER_API_KEY (tml-...)
    training = service.create_lora_training_client(base_model=args.base_model, rank=8).result()
    tokenizer = training.get_tokenizer()
    data = []
    for question, answer in (("2+2=", " 4"), ("3+5=", " 8"), ("7+1=", " 8")):
        prompt, completion = tokenizer.encode(question), tokenizer.encode(answer)
        tokens = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)  # train on the answer only
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    for step in range(args.steps):
        fwdbwd = training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-3))
        print(f"step {step}: loss {fwdbwd.result().metrics['loss:sum']:.4f}")
    print("saved", training.save_state("example").result().path)
    sampler = training.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(tokenizer.encode("2+2=")), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=0.7)).result()
    for seq in result.sequences:
        print(repr(tokenizer.decode(seq.tokens)), [round(lp, 3) for lp in seq.logprobs or []])


if __name__ == "__main__":
    main()
