"""The prompts both distillations learn from (`specdec distill`: distill.py, a pruned draft;
distill_feature.py, a feature draft): a text corpus split into passages, chat instructions made from
them and from topics (a fixed held-out split, none of the bench's own prompts), the chat template's
token ids and the target's end-of-sequence ids.

Apart from distill.py so that distill_feature.py uses them without importing distill.py, which
starts distill_feature.py in turn (no import cycle among the tools).
"""

from __future__ import annotations

import json
import pathlib
import random


FORTUNES = pathlib.Path("/usr/share/games/fortunes")
# Instruction shapes for chat prompts built from corpus passages (train) - the held-out split uses
# other passages, and the topic prompts below are split disjointly too.
PASSAGE_TEMPLATES = (
    "Explain what this means: {x}",
    "Summarize this in one sentence: {x}",
    "Write a short story inspired by this: {x}",
    "Is this true? Answer briefly and explain why: {x}",
    "Rewrite this in simpler words: {x}",
    "What is funny or wise about this? {x}",
)
TOPIC_TEMPLATES = (
    "Explain {x} to a child.",
    "What are the benefits and drawbacks of {x}?",
    "Write a short poem about {x}.",
    "Give me three tips about {x}.",
    "Why is {x} important?",
    "Describe the history of {x} in a few sentences.",
    # the shapes of an assistant's everyday questions (the project's chat prompts are of this kind)
    "What are three tips for getting better at {x}?",
    "Explain in simple terms how {x} works.",
    "What is the difference between {x} and {y}?",
    "Write a short story about {x}.",
    "Give me a plan for learning about {x} in one week.",
    "What are common mistakes people make with {x}?",
    "Suggest a name for a club about {x} and explain why it fits.",
    "What should I know before I start with {x}?",
    "List five facts about {x}.",
    "Write a haiku about {x}.",
    "How would you describe {x} to someone who has never seen it?",
    "Compare {x} and {y} in a short paragraph.",
    "What questions should I ask an expert on {x}?",
    "Write a friendly email inviting a colleague to a talk about {x}.",
    "Summarize the main ideas behind {x} in three bullet points.",
    "What is a surprising fact about {x}?",
    "Give me a recipe or a routine that involves {x}.",
    "How has {x} changed in the last hundred years?",
)
TOPICS = (
    "the ocean", "photosynthesis", "the internet", "cooking pasta", "exercise", "sleep", "the moon", "music",
    "gardening", "volcanoes", "recycling", "friendship", "computers", "rain", "electricity", "reading books",
    "the stock market", "bees", "mountains", "coffee", "learning a language", "the solar system", "dogs",
    "vaccines", "bicycles", "chess", "climate change", "the human heart", "democracy", "time management",
    "airplanes", "the printing press", "water", "robots", "the Roman empire", "birds", "saving money",
    "painting", "earthquakes", "trees", "mathematics", "smartphones", "the desert", "teamwork", "honey",
    "the brain", "trains", "public speaking", "the Arctic", "writing an essay", "cats", "bread", "stars",

    "volunteering", "the weather", "bridges", "the immune system", "chocolate", "soccer", "photography",
    "the Renaissance", "batteries", "rainforests", "meditation", "cheese", "the piano", "glaciers",
    "board games", "spiders", "solar panels", "libraries", "tea", "the Great Wall of China", "penguins",
    "typing on a keyboard", "running a marathon", "the Olympics", "kindness", "a vegetable garden",
    "the post office", "DNA", "wind turbines", "video games", "ancient Egypt", "camping", "owls",
    "a budget", "job interviews", "the telescope", "salt", "rivers", "sharks", "knitting", "hiking",
    "the compass", "pizza", "the violin", "sunflowers", "a refrigerator", "Python lists", "spreadsheets",
    "passwords", "the moon landing", "dinosaurs", "maps", "elephants", "yoga", "clocks", "soap",
    "a small bakery", "moving to a new city", "learning to swim", "snow", "the city bus", "origami",
    "first aid", "the alphabet", "rice", "lighthouses", "frogs", "a podcast", "composting", "umbrellas",
)


def load_corpus(paths: list[str]) -> list[str]:
    """Passages of the given text files or folders. Fortune files split on '%' lines, others on blank lines."""
    if not paths:
        if not FORTUNES.is_dir():
            raise FileNotFoundError(f"no --corpus given and the default corpus {FORTUNES} is missing: "
                                    "install it (Debian: apt-get install fortunes) or pass --corpus FILE_OR_DIR")
        paths = [str(FORTUNES)]
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix not in (".dat", ".u8") and not f.is_symlink())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path {p} does not exist")
    passages = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            text = f.read_bytes().decode("latin-1")
        sep = "\n%\n" if "\n%\n" in text else "\n\n"
        passages += [" ".join(part.split()) for part in text.split(sep) if len(part.split()) >= 4]
    if not passages:
        raise ValueError(f"corpus {paths} holds no passage of 4 words or more")
    return passages


def split_passages(passages: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out): a fixed 5% split, independent of --seed, so every run is judged alike."""
    order = passages[:]
    random.Random(1234).shuffle(order)
    cut = max(1, len(order) // 20)
    return order[cut:], order[:cut]


def make_prompts(passages: list[str], count: int, seed: int, heldout: bool) -> list[str]:
    """`count` distinct chat instructions; the held-out set uses passages and topics the training set
    never sees, and neither holds a prompt of the bench's own prompt sets (those measure the draft).

    Distinct because a greedy target continues a repeated prompt identically: a duplicate is a
    wasted sequence. Fewer than `count` come back only when the pool runs dry.
    """
    rng = random.Random(seed)
    pool = split_passages(passages)[1 if heldout else 0]
    topics = list(TOPICS[: len(TOPICS) // 4]) if heldout else list(TOPICS[len(TOPICS) // 4:])
    pool = [p for p in pool if len(p) <= 400] or pool
    seen, out = _bench_prompts(), []
    for i in range(count * 20):
        if len(out) == count:
            break
        if i % 3 == 2:
            x, y = rng.sample(topics, 2)
            text = rng.choice(TOPIC_TEMPLATES).format(x=x, y=y)
        else:
            text = rng.choice(PASSAGE_TEMPLATES).format(x=rng.choice(pool))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _bench_prompts() -> set[str]:
    """The user messages of specdec_tools/prompts/*.jsonl, which bench and loadtest measure with."""
    texts = set()
    for f in sorted((pathlib.Path(__file__).parent / "prompts").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                texts |= {m["content"] for m in json.loads(line).get("messages", []) if m.get("role") == "user"}
    return texts


def target_eos(model, tokenizer) -> set[int]:
    """The target's end-of-sequence ids: its generation config's, else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set([eos] if isinstance(eos, int) else (eos or [tokenizer.eos_token_id]))


def chat_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]
