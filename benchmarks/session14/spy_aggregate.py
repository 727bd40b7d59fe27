"""Where a thread's time goes, from a py-spy raw profile (`py-spy record -f raw --threads --idle`):
samples per stack below a frame (default Engine._turn), cut to --depth frames, with the leaf.

    python3 spy_aggregate.py PROFILE.txt [--thread ortspec-engine] [--below Engine._turn] [--depth 5]
"""
import argparse
import collections

parser = argparse.ArgumentParser()
parser.add_argument("profile")
parser.add_argument("--thread", default="ortspec-engine")
parser.add_argument("--below", default="Engine._turn")
parser.add_argument("--depth", type=int, default=5)
parser.add_argument("--top", type=int, default=40)
args = parser.parse_args()
total, below, stacks = 0, 0, collections.Counter()
for line in open(args.profile):
    stack, _, n = line.rstrip().rpartition(" ")
    parts = stack.split(";")
    if args.thread not in parts[0]:
        continue
    frames = [f.split(" (")[0] for f in parts[1:]]
    total += int(n)
    if args.below not in frames:
        stacks["(not below " + args.below + ") " + ";".join(frames[-2:])] += int(n)
        continue
    below += int(n)
    sub = frames[frames.index(args.below) + 1:]
    stacks[";".join(sub[: args.depth]) + " | " + sub[-1] if sub else "(itself)"] += int(n)
print(f"thread {args.thread}: {total} samples, {below} below {args.below}")
for stack, n in stacks.most_common(args.top):
    print(f"{n:6d} {100 * n / max(total, 1):5.1f}%  {stack}")
