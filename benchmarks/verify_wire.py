"""What one Verify exchange costs beyond the target's compute, with a real model: a gguf-a8 target
service on loopback and a client sending one sequence's steps, as the coordinator does.

    .venv/bin/python benchmarks/verify_wire.py [--steps 40] [--weights gguf-a8] [target flags...]
    # and where the time goes, from the scheduler, while it runs:
    perf sched record -a -o /tmp/sched.data -- sleep 1; perf sched timehist -w -i /tmp/sched.data

Per exchange: wall (the client's clock) less the compute the target reports, for a plain one-token
step (decode_ahead 0) and one that decodes 8 more tokens in the same exchange; medians over --steps.
Extra arguments go to `specdec serve target` (e.g. --compute-threads 1).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--weights", default="gguf-a8")
    args, target_flags = parser.parse_known_args()

    from coordinator.clients import TargetClient
    from specdec.model.loading import DEFAULT_TARGET, load_tokenizer
    from specdec.calls.request import VerifyCall
    from specdec.maths.sampling import SamplingConfig
    from specdec_tools.stacks import Stack
    from specdec_tools.workload import load_prompt_ids

    prompt = load_prompt_ids(load_tokenizer(DEFAULT_TARGET), "grounded", 1)[0]
    greedy = SamplingConfig()

    async def exchanges(address: str) -> None:
        client = TargetClient(address, timeout_s=60)
        try:
            for round_, ahead in enumerate((0, 8, 0, 8)):
                sequence = f"wire-{round_}"
                out = await client.verify(VerifyCall(sequence, 0, prompt, [], [], greedy))
                known, last, wires = len(prompt), out.next_token, []
                for _ in range(args.steps):
                    out = await client.verify(VerifyCall(sequence, known, [last], [], [], greedy, decode_ahead=ahead))
                    wires.append((out.wall_seconds - out.compute_seconds) * 1e6)
                    known += 1 + len(out.decoded)
                    last = (out.decoded or (out.next_token,))[-1]
                await client.release(sequence)
                print(f"decode_ahead {ahead}: wire {statistics.median(wires):.0f} us an exchange (median of {len(wires)}), "
                      f"compute {out.compute_seconds * 1e3:.2f} ms, prompt {len(prompt)} tokens", flush=True)
        finally:
            await client.close()

    with tempfile.TemporaryDirectory() as folder:
        stack = Stack("", pathlib.Path(folder) / "logs")
        try:
            address = stack.start_target("--weights", args.weights, *target_flags)
            stack.wait()
            asyncio.run(exchanges(address))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
