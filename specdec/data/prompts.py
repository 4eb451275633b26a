"""Chat prompts for distilling a draft head from the verifier, built in code: templates x topics.

Six categories, the same ones as the held-out benchmark set (`specdec/bench/prompts.json`):

- explain: "explain / how does / why" questions about a topic
- code: write, explain or fix small programs
- list: tips, ideas, pros and cons, checklists
- story: short stories, poems, fables
- chat: multi-turn conversations (a canned assistant turn, then a follow-up)
- extract: summaries of, and questions about, a passage included in the prompt

`training_prompts(n, seed)` returns n prompts interleaved across categories, so any prefix is
balanced. Nothing here overlaps the benchmark prompts (`benchmark_prompts()`): the benchmark
topics are kept out of these lists, and `training_prompts` drops any exact benchmark message.
`written_prompts` keeps the user turns the verifier writes itself (train-draft's second set),
under the same rule: none shares six words in a row with a benchmark prompt.
"""
from __future__ import annotations

import inspect
import json
import random
import re
from pathlib import Path

CATEGORIES = ["explain", "code", "list", "story", "chat", "extract"]

BENCH_PATH = Path(__file__).resolve().parent.parent / "bench" / "prompts.json"

# -- explain ------------------------------------------------------------------------------------
TOPICS = [
    "photosynthesis", "volcanoes", "earthquakes", "black holes", "the water cycle", "plate tectonics",
    "the immune system", "vaccines", "DNA", "evolution by natural selection", "the greenhouse effect",
    "ocean tides", "rainbows", "lightning", "magnets", "electric circuits", "nuclear fusion",
    "solar panels", "wind turbines", "batteries", "the internet", "email", "search engines", "compilers",
    "operating systems", "databases", "encryption", "public key cryptography", "machine learning",
    "neural networks", "blockchain", "cloud computing", "GPS", "Wi-Fi", "3D printing", "the stock market",
    "inflation", "interest rates", "supply and demand", "taxes", "insurance", "credit scores",
    "democracy", "the printing press", "the Roman Empire", "the Industrial Revolution", "the Renaissance",
    "the Silk Road", "ancient Egypt", "the Cold War", "the French Revolution", "the Moon landing",
    "honey bees", "coral reefs", "rainforests", "deserts", "glaciers", "bird migration", "hibernation",
    "sleep", "dreams", "memory", "the human heart", "digestion", "muscles", "vitamins", "caffeine",
    "meditation", "stress", "exercise", "bread baking", "fermentation", "coffee brewing", "chocolate",
    "jazz", "classical music", "the guitar", "photography", "oil painting", "chess", "the Olympic Games",
    "soccer", "basketball", "recycling", "plastic pollution", "composting", "electric cars", "airplanes",
    "rockets", "satellites", "the International Space Station", "Mars", "the Sun", "comets", "gravity",
    "time zones", "leap years", "calendars", "languages", "writing systems", "libraries", "newspapers",
    "podcasts", "social media", "video games", "virtual reality", "robots", "bridges", "skyscrapers",
    "dams", "earthquake-proof buildings", "clocks", "maps", "compasses", "microscopes", "telescopes",
    "antibiotics", "allergies", "the flu", "blood types", "the brain", "hearing", "color vision",
    "sound waves", "temperature", "atoms", "chemical reactions", "acids and bases", "salt", "soap",
    "clouds", "hurricanes", "snowflakes", "seasons", "rivers", "mountains", "islands", "wolves",
    "octopuses", "dolphins", "elephants", "ants", "mushrooms", "trees", "seeds", "fossils", "dinosaurs",
    "recursion", "sorting algorithms", "hash tables", "binary numbers", "version control with git",
    "unit testing", "APIs", "HTTP", "spreadsheets", "probability", "statistics", "fractions",
    "the Pythagorean theorem", "infinity", "money", "banks", "trade", "minimum wage", "renewable energy",
]

EXPLAIN_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a clear explanation.",
    "How does {t} work?",
    "Can you describe {t} to a high school student?",
    "Why is {t} important?",
    "Give me a short overview of {t}.",
    "What are the main ideas behind {t}?",
    "Explain the history of {t} briefly.",
    "What would a beginner need to know about {t}?",
    "Explain {t} using an everyday analogy.",
    "What are common misconceptions about {t}?",
    "Write a short paragraph explaining {t}.",
]

# -- code ---------------------------------------------------------------------------------------
CODE_TASKS = [
    "reverse a string", "compute the factorial of a number", "merge two sorted lists",
    "count how often each word appears in a text", "read a CSV file and print the average of each column",
    "validate an email address with a regular expression", "find the largest element in a list",
    "remove duplicates from a list while keeping the order", "convert Celsius to Fahrenheit",
    "compute the Fibonacci sequence up to n", "sort a list of dictionaries by a key",
    "check whether two strings are anagrams", "find the second largest number in a list",
    "implement binary search", "implement a stack class", "implement a queue with two stacks",
    "read a JSON file and print its keys", "download a web page and count its links",
    "rename all files in a folder to lowercase", "find all files larger than 1 MB in a directory",
    "compute the greatest common divisor of two numbers", "transpose a matrix",
    "count the vowels in a string", "generate a random password", "parse a date string",
    "compute the mean, median and mode of a list", "split a list into chunks of size n",
    "capitalize the first letter of every word", "check whether a year is a leap year",
    "convert a decimal number to binary", "find common elements of two lists",
    "implement bubble sort", "implement quicksort", "implement a linked list",
    "write a simple command-line calculator", "measure how long a function takes to run",
    "retry a function call up to three times", "cache the results of an expensive function",
    "read a large file line by line", "write a list of rows to a CSV file",
    "count the lines of code in a project", "find the longest word in a sentence",
    "rotate a list by k positions", "check whether a string contains only digits",
    "build a dictionary from two lists", "group a list of words by their first letter",
    "simulate rolling two dice 1000 times", "implement a simple to-do list in the terminal",
    "compute compound interest", "convert a Roman numeral to an integer",
    "validate that brackets in a string are balanced", "implement a least-recently-used cache",
    "run two tasks concurrently with threads", "make an HTTP GET request and parse the JSON response",
    "log messages to a file with timestamps", "parse command-line arguments",
    "compute the distance between two points", "find the most common element in a list",
    "shuffle a deck of cards", "compress a string with run-length encoding",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "Java", "C", "Go", "Rust", "Bash"]
CODE_TEMPLATES = [
    "Write a {lang} function to {task}.",
    "Show me how to {task} in {lang}, with a short explanation.",
    "I need {lang} code to {task}. Can you help?",
    "Write a {lang} program to {task} and explain how it works.",
    "How do I {task} in {lang}?",
    "Write a well-commented {lang} function to {task}, with an example call.",
]
SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "def g(s):\n    out = {}\n    for ch in s:\n        out[ch] = out.get(ch, 0) + 1\n    return out",
    "import os\nfor root, dirs, files in os.walk('.'):\n    for name in files:\n        if name.endswith('.txt'):\n            print(os.path.join(root, name))",
    "def h(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "with open('data.txt') as f:\n    lines = [line.strip() for line in f if line.strip()]\nprint(len(lines))",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n    def inc(self):\n        self.n += 1\n        return self.n",
    "const total = items.reduce((sum, item) => sum + item.price * item.qty, 0);",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name ORDER BY orders DESC;",
    "def avg(xs):\n    return sum(xs) / len(xs)\n\nprint(avg([]))",
    "for i in range(10):\n    if i = 5:\n        print('five')",
    "def add_item(item, items=[]):\n    items.append(item)\n    return items",
    "numbers = [3, 1, 2]\nsorted_numbers = numbers.sort()\nprint(sorted_numbers[0])",
    "import json\ndata = json.loads(text)\nfor key, value in data.items():\n    print(f'{key}: {value}')",
    "words = text.split()\nlongest = max(words, key=len)\nprint(longest)",
    "x = input('Number: ')\nprint(x + 1)",
    "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        return False",
]
SNIPPET_TEMPLATES = [
    "What does this code do?\n\n```\n{s}\n```",
    "Explain this code line by line:\n\n```\n{s}\n```",
    "Is there a bug in this code? If so, how do I fix it?\n\n```\n{s}\n```",
    "How could I make this code cleaner?\n\n```\n{s}\n```",
]

# -- list ---------------------------------------------------------------------------------------
GOALS = [
    "staying productive while working from home", "learning a new language", "saving money on groceries",
    "getting better sleep", "studying for exams", "starting a small business", "writing a novel",
    "learning to play the piano", "keeping a clean kitchen", "making new friends in a new city",
    "improving public speaking", "reducing screen time", "staying motivated to exercise",
    "learning to program", "managing stress at work", "planning a wedding on a budget",
    "keeping a journal", "reading more books", "organizing a small apartment", "raising a puppy",
    "teaching kids about money", "growing vegetables on a balcony", "writing a good resume",
    "running an effective meeting", "learning to draw", "taking better photos with a phone",
    "staying safe online", "driving in the snow", "traveling with young children", "hosting a dinner party",
    "writing clear emails", "becoming a better listener", "preparing for a marathon",
    "learning chess", "moving to a new house", "keeping a car in good shape", "studying math",
]
THINGS = [
    "a birthday party", "a science fair project", "a rainy afternoon", "a family reunion",
    "a team-building day", "a school fundraiser", "a short film", "a mobile app", "a blog",
    "a board game night", "a road trip", "a small garden", "a youth soccer practice", "a podcast episode",
    "a weekend in a big city", "a healthy breakfast", "a class presentation", "a community event",
    "a holiday gift for a coworker", "a beginner woodworking project",
]
LIST_TEMPLATES = [
    "List {n} tips for {g}.",
    "What are {n} common mistakes people make when {g}?",
    "Give me a step-by-step plan for {g}.",
    "Make a short checklist for {g}.",
    "Give me {n} ideas for {x}.",
    "What are {n} things to consider when planning {x}?",
    "What are {n} benefits of {t}?",
    "What are the pros and cons of {t}?",
    "List {n} interesting facts about {t}.",
    "Give me {n} questions I could ask an expert on {t}.",
]

# -- story --------------------------------------------------------------------------------------
CHARACTERS = [
    "a shy robot", "an old fisherman", "a young wizard", "a curious fox", "a retired astronaut",
    "a baker in a small village", "a lost puppy", "a girl who can talk to trees", "a detective with a cold",
    "two rival chefs", "a dragon afraid of fire", "a boy who collects clouds", "a clockmaker",
    "a mail carrier on Mars", "a grandmother who learns to code", "a street musician", "a sleepy owl",
    "a knight who hates armor", "a ghost who wants friends", "a lonely giant",
]
PLOTS = [
    "finds a mysterious map", "loses something important", "has to win a contest", "makes an unlikely friend",
    "discovers a hidden door", "must deliver a package before midnight", "learns a secret about the town",
    "gets stuck in a snowstorm", "builds something amazing", "travels to the edge of the world",
]
STORY_TEMPLATES = [
    "Write a short story about {c} who {p}.",
    "Tell me a bedtime story about {c}.",
    "Write a funny short story about {c} who {p}.",
    "Write the opening paragraph of an adventure story about {c}.",
    "Write a poem about {t}.",
    "Write a short fable about {c}, with a moral at the end.",
    "Write a haiku sequence about {t}.",
    "Write a diary entry from the point of view of {c} who {p}.",
]

# -- chat (multi-turn) --------------------------------------------------------------------------
CHAT_FLOWS = [
    ("I'm trying to get better at {g}. Where should I start?",
     "Good question! A good first step is to set one small, concrete goal and build a routine around it. "
     "How much time can you spend on it each week?",
     "About {m} minutes a day. What should I do this week?"),
    ("Can you help me understand {t}?",
     "Of course. Would you like a quick definition first, or a more detailed explanation with examples?",
     "A quick definition first, then one everyday example please."),
    ("I have to give a short talk about {t} tomorrow.",
     "That sounds exciting! A clear structure helps: an opening hook, two or three main points, and a short summary.",
     "Can you suggest the three main points and an opening sentence?"),
    ("My friend says {t} is boring. I disagree.",
     "It can seem dry at first, but there are some surprising stories and facts behind it.",
     "Give me three fun facts I can tell my friend."),
    ("I need to {task} in {lang}.",
     "Sure, I can help with that. Do you have any constraints, like libraries you can or cannot use?",
     "No constraints. Please show me the code and explain it briefly."),
    ("I'm planning {x}.",
     "Fun! What is your budget and how many people will be involved?",
     "A small budget and about {m} people. Any suggestions?"),
    ("What's a good way to explain {t} to a child?",
     "Using simple comparisons to everyday things usually works well.",
     "Can you write that explanation for a seven-year-old?"),
    ("Thanks for the help earlier with {g}.",
     "You're welcome! How is it going so far?",
     "Pretty well, but I keep losing motivation. What can I do?"),
]
SYSTEMS = [None, None, "You are a friendly and concise assistant.", "You are a patient tutor.",
           "You are an expert who explains things clearly."]
FOLLOWUPS_ON_PASSAGE = [
    "Can you summarize what you just said in three bullet points?",
    "Can you explain that more simply?",
    "What is the most important point in your answer?",
    "Can you shorten that to two sentences?",
]

# -- extract ------------------------------------------------------------------------------------
PASSAGES = [
    "The town of Millbrook was founded in 1823 by a group of farmers who settled along the Willow River. "
    "For most of the nineteenth century the town depended on a single grain mill, which gave it its name. "
    "When the railway arrived in 1871, Millbrook grew quickly: a school, two churches and a small hospital were "
    "built within a decade. Today the old mill is a museum, and the town is known for its autumn harvest fair, "
    "which draws visitors from across the region.",
    "Sea otters spend almost their entire lives in the water. Unlike most marine mammals, they have no layer of "
    "blubber; instead they rely on the densest fur of any animal, with up to a million hairs per square inch. "
    "To keep that fur insulating, otters groom themselves for hours every day. They eat sea urchins, crabs and "
    "clams, often using rocks as tools to crack the shells open while floating on their backs. By keeping sea "
    "urchin populations in check, otters help protect kelp forests.",
    "The company's quarterly report shows revenue of 4.2 million dollars, up 12 percent from the same quarter "
    "last year. Most of the growth came from the new subscription service, which now has 18,000 customers. "
    "Costs also rose, mainly because the company hired 25 new employees and opened an office in Denver. "
    "Management expects growth to slow slightly next quarter but plans to launch two new products before the "
    "end of the year.",
    "Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891 to study physics and mathematics at the "
    "Sorbonne. Together with her husband Pierre, she studied radioactivity and discovered two new elements, "
    "polonium and radium. She became the first woman to win a Nobel Prize, in 1903, and later won a second Nobel "
    "Prize in chemistry in 1911. She remains the only person to have won Nobel Prizes in two different sciences.",
    "To apply for the community garden program, residents must fill out the online form by March 15. Each "
    "household may request one plot. Plots are assigned by lottery at the end of March, and the annual fee is "
    "30 dollars, which covers water and shared tools. Gardeners are expected to keep their plots weeded and to "
    "volunteer for at least four hours during the season. Plots that are not planted by June 1 may be reassigned.",
    "The James Webb Space Telescope launched on December 25, 2021. It observes mainly in infrared light, which "
    "lets it see through clouds of dust and detect the faint light of very distant galaxies. Its main mirror is "
    "6.5 meters wide and made of 18 gold-coated segments. The telescope orbits the Sun near a point about 1.5 "
    "million kilometers from Earth, where a large sunshield keeps its instruments extremely cold.",
    "Our new return policy takes effect on the first of next month. Customers may return most items within 30 "
    "days of delivery for a full refund, as long as the items are unused and in their original packaging. "
    "Electronics must be returned within 15 days. Sale items can be exchanged but not refunded. Refunds are "
    "issued to the original payment method within five business days after we receive the return.",
    "Sourdough bread is made with a starter, a mixture of flour and water that contains wild yeast and lactic "
    "acid bacteria. The bacteria produce acids that give the bread its tangy flavor, while the yeast produces "
    "gas that makes the dough rise. Because wild yeast works more slowly than commercial yeast, sourdough often "
    "rises for many hours. Bakers feed their starters regularly with fresh flour and water to keep them active.",
    "The meeting on Tuesday covered three topics. First, the team agreed to move the product launch from May to "
    "June to allow more time for testing. Second, Priya will lead a new working group on customer feedback, "
    "with a first report due in two weeks. Third, the travel budget for the rest of the year was reduced by 20 "
    "percent. The next meeting is scheduled for Thursday at 10 a.m.",
    "The Great Barrier Reef, off the coast of Queensland, Australia, is the largest coral reef system in the "
    "world. It stretches for more than 2,300 kilometers and is made up of nearly 3,000 individual reefs. The reef "
    "is home to thousands of species of fish, corals, and mollusks. Rising ocean temperatures have caused several "
    "mass bleaching events in recent decades, in which corals expel the algae that live in their tissues.",
    "A password manager is a program that stores your passwords in an encrypted vault. You only need to remember "
    "one strong master password to unlock it. Most password managers can generate long random passwords, fill "
    "them in automatically on websites, and sync them across your devices. Security experts recommend using a "
    "unique password for every account, which is practical only with a tool like this.",
    "In 1928, Alexander Fleming returned from a vacation to find that mold had grown on one of his bacterial "
    "culture plates. Around the mold, the bacteria had been killed. He identified the mold as Penicillium and "
    "named the substance it produced penicillin. It took more than a decade, and the work of Howard Florey and "
    "Ernst Chain, before penicillin could be produced in large amounts and used to treat infections.",
]
EXTRACT_TEMPLATES = [
    "Summarize the following text in two or three sentences.\n\n{p}",
    "Read this passage and list its main points.\n\n{p}",
    "{p}\n\nBased on the passage above, what is the main topic and what are the key details?",
    "Here is a text:\n\"\"\"\n{p}\n\"\"\"\nWrite a one-sentence summary, then explain one detail from it.",
    "Extract all names, numbers and technical terms mentioned in this text:\n\n{p}",
    "Answer using only the passage: what does it say about {w}?\n\n{p}",
    "Rewrite this passage in simpler words:\n\n{p}",
    "Write three questions that can be answered from this passage, and answer them.\n\n{p}",
    "TL;DR:\n\n{p}",
]
DOC_MODULES = [
    "json", "csv", "collections", "itertools", "functools", "pathlib", "logging", "argparse", "datetime",
    "random", "statistics", "textwrap", "heapq", "bisect", "string", "re", "unittest", "sqlite3", "zipfile",
    "tarfile", "shutil", "subprocess", "threading", "queue", "asyncio", "decimal", "fractions", "dataclasses",
    "enum", "typing", "contextlib", "tempfile", "glob", "fnmatch", "hashlib", "base64", "pickle", "copy",
    "pprint", "difflib", "urllib.parse", "http.client", "email.message", "uuid", "secrets", "struct",
    "operator", "inspect", "abc", "weakref", "gzip", "configparser", "calendar", "time", "os.path",
]


def docstring_passages(min_chars: int = 300, max_chars: int = 900) -> list[str]:
    """Docstrings of stdlib modules and their public members, trimmed to whole sentences."""
    import importlib

    out, seen = [], set()
    for name in DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this Python lacks
            continue
        members = [mod] + [getattr(mod, a) for a in sorted(vars(mod)) if not a.startswith("_")]
        for obj in members:
            try:
                doc = inspect.getdoc(obj) if (obj is mod or inspect.isclass(obj) or inspect.isfunction(obj)) else None
            except Exception:  # noqa: BLE001
                doc = None
            if not doc or len(doc) < min_chars or doc in seen:
                continue
            seen.add(doc)
            out.append(trim(doc, max_chars))
    return out


def trim(text: str, max_chars: int) -> str:
    """Cut at the last sentence or paragraph end before max_chars."""
    if len(text) <= max_chars:
        return text.strip()
    cut = text[:max_chars]
    end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind("\n\n"))
    return (cut[: end + 1] if end > max_chars // 3 else cut).strip()


def keyword(passage: str, rng: random.Random) -> str:
    words = [w for w in re.findall(r"[A-Za-z][a-z]{5,}", passage)]
    return rng.choice(words).lower() if words else "the topic"


def _user(content: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": content}]


def _category_pools(rng: random.Random, passages: list[str]) -> dict[str, list[list[dict]]]:
    n = lambda: rng.choice([3, 4, 5, 5, 6, 7, 8, 10])  # noqa: E731
    pools: dict[str, list] = {c: [] for c in CATEGORIES}
    for t in TOPICS:
        for tpl in rng.sample(EXPLAIN_TEMPLATES, 4):
            pools["explain"].append(_user(tpl.format(t=t), rng.choice(SYSTEMS)))
    for task in CODE_TASKS:
        for tpl in rng.sample(CODE_TEMPLATES, 3):
            pools["code"].append(_user(tpl.format(task=task, lang=rng.choice(LANGS))))
    for s in SNIPPETS:
        for tpl in SNIPPET_TEMPLATES:
            pools["code"].append(_user(tpl.format(s=s)))
    for g in GOALS:
        for tpl in rng.sample(LIST_TEMPLATES[:4], 3):
            pools["list"].append(_user(tpl.format(n=n(), g=g)))
    for x in THINGS:
        for tpl in LIST_TEMPLATES[4:6]:
            pools["list"].append(_user(tpl.format(n=n(), x=x)))
    for t in rng.sample(TOPICS, 120):
        pools["list"].append(_user(rng.choice(LIST_TEMPLATES[6:]).format(n=n(), t=t)))
    for c in CHARACTERS:
        for tpl in rng.sample(STORY_TEMPLATES, 5):
            pools["story"].append(_user(tpl.format(c=c, p=rng.choice(PLOTS), t=rng.choice(TOPICS))))
    for _ in range(6):
        for flow in CHAT_FLOWS:
            fill = dict(g=rng.choice(GOALS), t=rng.choice(TOPICS), task=rng.choice(CODE_TASKS),
                        lang=rng.choice(LANGS[:5]), x=rng.choice(THINGS), m=rng.choice([10, 15, 20, 30, 45, 60]))
            sys_msg = rng.choice(SYSTEMS)
            msgs = [{"role": "system", "content": sys_msg}] if sys_msg else []
            msgs += [{"role": "user", "content": flow[0].format(**fill)},
                     {"role": "assistant", "content": flow[1].format(**fill)},
                     {"role": "user", "content": flow[2].format(**fill)}]
            pools["chat"].append(msgs)
    for p in rng.sample(passages, min(len(passages), 60)):  # a passage as the assistant's own earlier turn
        pools["chat"].append([{"role": "user", "content": f"Tell me about {keyword(p, rng)}."},
                              {"role": "assistant", "content": p},
                              {"role": "user", "content": rng.choice(FOLLOWUPS_ON_PASSAGE)}])
    for p in passages:
        for tpl in rng.sample(EXTRACT_TEMPLATES, 2):
            pools["extract"].append(_user(tpl.format(p=p, w=keyword(p, rng))))
    return pools


def training_prompts(n: int | None = None, seed: int = 0, docstrings: bool = True) -> list[dict]:
    """Up to n prompts `{"category", "messages"}`, round-robin over the categories (each pool
    shuffled with `seed`), with every benchmark prompt removed."""
    rng = random.Random(seed)
    passages = list(PASSAGES) * 3 + (docstring_passages() if docstrings else [])
    pools = _category_pools(rng, passages)
    bench = {json.dumps(p["messages"], sort_keys=True) for p in benchmark_prompts()}
    for c in CATEGORIES:
        rng.shuffle(pools[c])
        pools[c] = [m for m in pools[c] if json.dumps(m, sort_keys=True) not in bench]
    out, i = [], 0
    total = sum(len(v) for v in pools.values())
    while len(out) < (total if n is None else min(n, total)):
        for c in CATEGORIES:
            if i < len(pools[c]):
                out.append({"category": c, "messages": pools[c][i]})
        i += 1
    return out[:n] if n is not None else out


def benchmark_prompts() -> list[dict]:
    """The held-out benchmark set (never trained on)."""
    return json.loads(BENCH_PATH.read_text()) if BENCH_PATH.exists() else []


def _six_grams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + 6]) for i in range(len(words) - 5)}


def written_prompts(turns: list[str], min_chars: int = 8) -> list[dict]:
    """User turns the verifier wrote itself, as prompts `{"category": "written", "messages"}`:
    each once, none shorter than min_chars, none sharing six words in a row with a benchmark
    prompt (a turn that close to one would train the head on the benchmark's own answers)."""
    bench = set().union(*(_six_grams(m["content"]) for p in benchmark_prompts() for m in p["messages"]
                          if m["role"] == "user"))
    seen, out = set(), []
    for text in (t.strip() for t in turns):
        key = re.sub(r"\W+", " ", text.lower()).strip()
        if len(text) < min_chars or key in seen or _six_grams(text) & bench:
            continue
        seen.add(key)
        out.append({"category": "written", "messages": [{"role": "user", "content": text}]})
    return out
