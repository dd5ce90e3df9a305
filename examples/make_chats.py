"""Write a small chat file for trying fine-tuning: arithmetic questions and answers.

    python examples/make_chats.py runs/chats.jsonl [--count 2000] [--seed 0]

One conversation per line, ``{"messages": [{"role", "content"}, ...]}``: an optional
system message, then one to three user questions, each answered by the assistant.
The answers follow a fixed pattern, so a small model learns them within minutes on a
CPU, and only the answers are trained on (``prepare --chat``'s default).
"""

import argparse
import json
import random
from pathlib import Path


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": "Answer with the sum."}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages.append({"role": "user", "content": f"What is {a} + {b}?"})
        messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}."})
    return {"messages": messages}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the .jsonl file to write")
    ap.add_argument("--count", type=int, default=2000, help="conversations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(args.count)))
    print(f"{args.count} conversations -> {out}")


if __name__ == "__main__":
    main()
