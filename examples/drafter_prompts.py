"""Templated training prompts for the default drafter: chat, code, everyday maths.

Every prompt is built here from our own templates and word lists (no text from any
public benchmark: GSM8K, HumanEval, MBPP, MT-Bench, Alpaca, MATH, AIME, ... are
never read), deterministically from a seed. The target (SmolLM2-135M-Instruct)
answers them and the drafter learns from its answers (see
``train_default_drafter.py``). ``near_duplicates`` checks a prompt list against the
held-out evaluation and calibration prompts; ``build_prompts`` drops any it finds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable

# fmt: off
TOPICS = (
    "photosynthesis", "the water cycle", "gravity", "volcanoes", "earthquakes", "rainbows",
    "the moon's phases", "tides", "electricity", "magnets", "the immune system", "vaccines",
    "DNA", "evolution", "climate change", "renewable energy", "solar panels", "batteries",
    "the internet", "email", "encryption", "passwords", "databases", "recursion",
    "sorting algorithms", "binary numbers", "machine learning", "neural networks",
    "compilers", "operating systems", "cloud computing", "open source software",
    "version control", "unit testing", "the stock market", "inflation", "interest rates",
    "budgeting", "saving money", "compound interest", "supply and demand", "taxes",
    "the Roman Empire", "the printing press", "the Industrial Revolution", "democracy",
    "the Renaissance", "ancient Egypt", "the Silk Road", "the French Revolution",
    "bread baking", "making pasta", "composting", "growing tomatoes", "houseplants",
    "birdwatching", "hiking", "camping", "running a marathon", "swimming", "yoga",
    "meditation", "learning a language", "public speaking", "time management",
    "writing a resume", "job interviews", "remote work", "team meetings", "negotiation",
    "chess", "jazz", "the violin", "oil painting", "photography", "poetry", "novels",
    "coffee", "chocolate", "honey bees", "whales", "octopuses", "penguins", "elephants",
    "dogs", "cats", "forests", "deserts", "rivers", "mountains", "oceans", "the stars",
    "Mars", "the Sun", "comets", "airplanes", "bicycles", "trains",
    "electric cars", "bridges", "skyscrapers", "recycling", "first aid", "healthy eating",
    "glaciers", "coral reefs", "rainforests", "wind turbines", "nuclear power", "vitamins",
    "the human heart", "bones and muscles", "the five senses", "dreams", "memory",
    "habits", "motivation", "friendship", "kindness", "teamwork", "leadership",
    "the Olympic Games", "football", "basketball", "tennis", "cycling races", "gardening",
    "knitting", "pottery", "woodworking", "board games", "video games", "libraries",
    "museums", "maps", "compasses", "clocks", "calendars", "money", "banks", "credit cards",
    "small businesses", "marketing", "customer service", "spreadsheets", "keyboards",
    "smartphones", "satellites", "GPS", "radio", "television", "cinema", "theatre",
    "the piano", "drums", "opera", "folk tales", "fairy tales", "mythology", "castles",
    "pirates", "the Vikings", "ancient Greece", "the Great Wall of China", "pyramids",
    "tea ceremonies", "spices", "cheese making", "fermentation", "vegetarian cooking",
)
TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is the most important thing to know about {t}?",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are some common misconceptions about {t}?",
    "Write a paragraph about the history of {t}.",
    "List the pros and cons of {t}.",
    "What are some tips for a beginner interested in {t}?",
    "Summarise what you know about {t} in two sentences.",
    "Why does {t} matter?",
    "Write a haiku about {t}.",
    "Give me a quiz of three questions about {t}, with answers.",
    "Describe {t} as if you were a tour guide.",
    "What questions should I ask an expert on {t}?",
    "Write a short blog post introduction about {t}.",
    "How has {t} changed over the last hundred years?",
    "Tell me a fun fact about {t} that most people do not know.",
    "Write a tweet-length message about {t}.",
    "What would a good book about {t} cover?",
    "Make an outline for a school presentation on {t}.",
    "What vocabulary words should I learn to talk about {t}?",
    "Compare {t} with something from everyday life.",
    "Write a dialogue between two friends talking about {t}.",
    "What careers are connected to {t}?",
)
PEOPLE = (
    "my landlord", "my manager", "a colleague", "my neighbour", "my teacher", "a customer",
    "my sister", "an old friend", "the school principal", "a new client", "my team",
    "the city council", "my grandmother", "a hotel", "a plumber", "the library",
)
PURPOSES = (
    "asking for a day off next Friday", "about a broken heater", "to say thank you for their help",
    "to reschedule our meeting", "to apologise for a late reply", "inviting them to a small party",
    "asking for feedback on my work", "about a noisy party next door", "to confirm a booking",
    "asking about a refund", "to introduce myself", "to share some good news",
)
ACTIVITIES = (
    "a birthday party for a seven-year-old", "a week of healthy dinners", "a road trip",
    "a study schedule for exams", "moving to a new flat", "a garage sale", "a picnic",
    "a team-building day", "learning to cook", "starting to run", "a quiet weekend at home",
    "a small wedding", "a charity bake sale", "spring cleaning", "a first trip abroad",
    "a book club", "a home office", "a family reunion", "a vegetable garden", "a job search",
)
TASK_TEMPLATES = (
    "Write a polite email to {p} {q}.",
    "Write a short text message to {p} {q}.",
)
PLAN_TEMPLATES = (
    "Help me plan {a}.",
    "Make a checklist for {a}.",
    "What should I think about before {a}? Give me a list.",
    "Give me a simple budget for {a}.",
)
CODE_TOPICS = (
    "reverse a string", "check whether a number is prime", "count the words in a file",
    "read a CSV file and sum one column", "merge two sorted lists", "find duplicates in a list",
    "compute the factorial of a number", "flatten a nested list", "parse a date string",
    "remove punctuation from a sentence", "compute the average of a list of numbers",
    "sort a dictionary by its values", "generate the first n Fibonacci numbers",
    "check that an email address looks valid", "convert Celsius to Fahrenheit",
    "find the largest element in a list", "write a dictionary to a JSON file",
    "capitalise every word in a sentence", "check whether a string is a palindrome",
    "count the vowels in a string", "implement binary search", "group words by their first letter",
    "shuffle a list", "remove duplicate lines from a text file", "find the most common word in a text",
    "rotate a list by k positions", "check whether two strings are anagrams",
    "convert a Roman numeral to an integer", "convert an integer to binary", "transpose a matrix",
    "multiply two matrices", "compute the greatest common divisor of two numbers",
    "split a list into chunks of a given size", "find the second largest number in a list",
    "count how often each character appears", "read a text file and print it in reverse order",
    "validate a password against simple rules", "compute the median of a list",
    "merge two dictionaries", "find all files with a given extension in a folder",
    "format a number with thousands separators", "compute compound interest",
    "implement a simple stack class", "implement a queue with two stacks",
    "implement a linked list with append and remove", "check balanced parentheses in a string",
    "compute the edit distance between two words", "generate all permutations of a list",
    "generate all subsets of a set", "find the longest word in a sentence",
    "convert a list of tuples into a dictionary", "time how long a function takes",
    "retry a function call up to three times", "cache the results of a slow function",
    "parse command-line arguments with argparse", "log messages to a file",
    "run a shell command and capture its output", "zip two lists into a dictionary",
    "compute the distance between two points", "draw a text histogram of numbers",
    "count the lines of code in a Python file", "convert snake_case to camelCase",
    "truncate a long string with an ellipsis", "find the intersection of two lists",
    "remove None values from a dictionary", "sort a list of people by age",
    "check whether a year is a leap year", "compute the sum of the digits of a number",
    "print a multiplication table", "simulate rolling two dice many times",
    "pick a random password of given length", "read a config file with configparser",
    "compress a folder into a zip file", "compute a moving average", "normalise a list of numbers",
    "find pairs in a list that add up to a target", "encode and decode base64",
    "compute the SHA-256 hash of a file", "download a web page and count its links",
)
CODE_TEMPLATES = (
    "Write a Python function to {t}.",
    "Show me how to {t} in Python, with a short explanation.",
    "Write a Python function to {t}, with a docstring and type hints.",
    "How can I {t} in Python? Show the code.",
    "Write a small Python script to {t} and print the result.",
    "Write pytest tests for a function that should {t}.",
    "What is the simplest way to {t} in Python?",
    "Write a JavaScript function to {t}.",
    "Explain step by step how a program would {t}, then give Python code.",
)
# fmt: on


def _money(rng: random.Random, low: int, high: int) -> str:
    return f"{rng.randint(low, high)}.{rng.choice(('00', '50', '25', '99', '75'))}"


def _maths_templates() -> list[Callable[[random.Random], str]]:
    """Everyday arithmetic as someone would ask it; numbers drawn per prompt."""

    def percent(g: random.Random) -> str:
        return f"What is {g.choice((5, 10, 12, 15, 20, 25, 30, 40, 75))}% of {g.randint(20, 900)}?"

    def sale(g: random.Random) -> str:
        return (
            f"A jacket costs ${_money(g, 20, 300)} and is {g.choice((10, 15, 20, 25, 30, 40, 50))}% "
            "off today. What do I pay?"
        )

    def bill(g: random.Random) -> str:
        return (
            f"We are {g.randint(2, 9)} friends and the dinner bill is ${_money(g, 40, 400)}. "
            f"With a {g.choice((10, 12, 15, 18, 20))}% tip, how much does each of us pay?"
        )

    def saving(g: random.Random) -> str:
        return (
            f"If I put aside ${g.choice((25, 40, 50, 75, 100, 150, 200, 250))} every month, "
            f"how much will I have after {g.randint(3, 36)} months?"
        )

    def fuel(g: random.Random) -> str:
        return (
            f"My car uses {g.randint(4, 11)}.{g.randint(0, 9)} litres per 100 km. How much fuel "
            f"do I need for a {g.randint(30, 900)} km drive?"
        )

    def clock(g: random.Random) -> str:
        return (
            f"My train leaves at {g.randint(5, 21)}:{g.choice(('05', '15', '20', '35', '45', '50'))} "
            f"and the trip takes {g.randint(25, 260)} minutes. When do I arrive?"
        )

    def times(g: random.Random) -> str:
        return f"What is {g.randint(12, 999)} times {g.randint(3, 99)}? Show the steps."

    def divide(g: random.Random) -> str:
        return f"Divide {g.randint(100, 9999)} by {g.randint(3, 48)} and round to two decimals."

    def carpet(g: random.Random) -> str:
        return (
            f"My room is {g.randint(2, 9)}.{g.choice((0, 5))} m by {g.randint(2, 9)} m. "
            "How many square metres of flooring should I buy?"
        )

    def unit_price(g: random.Random) -> str:
        a, b = g.choice((200, 250, 400, 500)), g.choice((750, 1000, 1500))
        return (
            f"Which is the better deal: {a} g of rice for ${_money(g, 1, 4)} or {b} g "
            f"for ${_money(g, 3, 9)}?"
        )

    def minutes(g: random.Random) -> str:
        unit = g.choice(("days", "weeks", "hours"))
        return f"How many minutes are there in {g.randint(2, 30)} {unit}?"

    def average(g: random.Random) -> str:
        nums = ", ".join(str(g.randint(1, 120)) for _ in range(g.randint(3, 7)))
        return f"What is the average of {nums}?"

    def fraction(g: random.Random) -> str:
        k = g.randint(2, 12)
        return f"Simplify the fraction {k * g.randint(1, 12)}/{k * g.randint(2, 15)}."

    def plan(g: random.Random) -> str:
        return (
            f"My phone plan costs ${g.randint(5, 40)} a month plus ${g.randint(1, 9)} for every "
            f"GB of data. What do I pay in a month where I use {g.randint(1, 25)} GB?"
        )

    def miles(g: random.Random) -> str:
        return f"Convert {g.randint(1, 500)} miles to kilometres."

    def celsius(g: random.Random) -> str:
        return f"It is {g.randint(-20, 40)} degrees Celsius outside. What is that in Fahrenheit?"

    def recipe(g: random.Random) -> str:
        return (
            f"A pancake recipe uses {g.randint(100, 400)} g of flour for {g.randint(2, 6)} people. "
            f"How much flour do I need for {g.randint(3, 14)} people?"
        )

    def interest(g: random.Random) -> str:
        return (
            f"I have ${g.randint(5, 200) * 100} in a savings account that pays "
            f"{g.choice((1, 1.5, 2, 2.5, 3, 4, 5))}% interest a year, compounded yearly. "
            f"How much will I have after {g.randint(2, 15)} years?"
        )

    def pace(g: random.Random) -> str:
        return (
            f"I ran {g.randint(3, 21)} km in {g.randint(18, 130)} minutes. What was my average "
            "pace per kilometre?"
        )

    def paint(g: random.Random) -> str:
        return (
            f"One litre of paint covers {g.randint(6, 12)} square metres. How many litres do I "
            f"need for a wall {g.randint(2, 8)} m wide and {g.choice((2.4, 2.5, 2.7, 3))} m high?"
        )

    def wage(g: random.Random) -> str:
        return (
            f"I earn ${g.randint(12, 45)} an hour and work {g.randint(10, 45)} hours a week. "
            "What do I earn in a year of 48 working weeks?"
        )

    def ages(g: random.Random) -> str:
        return (
            f"I was born in {g.randint(1940, 2015)}. How old will I be on my birthday in "
            f"{g.randint(2026, 2060)}?"
        )

    return [
        percent, sale, bill, saving, fuel, clock, times, divide, carpet, unit_price,
        minutes, average, fraction, plan, miles, celsius, recipe, interest, pace, paint,
        wage, ages,
    ]  # fmt: skip


def chat_prompts(rng: random.Random) -> list[str]:
    """Every templated everyday chat request, shuffled."""
    prompts = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    prompts += [
        tpl.format(p=p, q=q) for p in PEOPLE for q in PURPOSES for tpl in TASK_TEMPLATES
    ]
    prompts += [tpl.format(a=a) for a in ACTIVITIES for tpl in PLAN_TEMPLATES]
    rng.shuffle(prompts)
    return prompts


def code_prompts(rng: random.Random) -> list[str]:
    """Every templated programming request, shuffled."""
    prompts = [tpl.format(t=t) for t in CODE_TOPICS for tpl in CODE_TEMPLATES]
    rng.shuffle(prompts)
    return prompts


def maths_prompts(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct everyday arithmetic questions, templates taken in turn."""
    templates = _maths_templates()
    prompts, seen = [], set()
    attempts = 0
    while len(prompts) < count and attempts < 100 * count:
        attempts += 1
        prompt = templates[len(prompts) % len(templates)](rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


STOPWORDS = frozenset(
    "a an the and or of to in on at for with by from about as is are was be do does did "
    "i me my we our you your it its this that what how why which who when can could "
    "would should some any me give tell".split()
)


def content_words(text: str) -> frozenset[str]:
    """Lower-cased words minus stopwords, a plural ``s`` stripped."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return frozenset(
        w[:-1] if len(w) > 3 and w.endswith("s") else w
        for w in words
        if w not in STOPWORDS
    )


def near_duplicates(
    prompts: Iterable[str], held_out: Iterable[str], threshold: float = 0.6
) -> list[tuple[str, str, float]]:
    """``(prompt, held-out prompt, similarity)`` for pairs at least ``threshold`` alike.

    Similarity is the Jaccard index of the content words: "Explain black holes in
    simple terms." and "Explain what a black hole is in simple terms." score 1.0,
    a shared template frame with another subject ("Explain compilers in simple
    terms.") 0.5.
    """
    held = [(h, content_words(h)) for h in held_out]
    found = []
    for prompt in prompts:
        words = content_words(prompt)
        for original, other in held:
            union = len(words | other)
            score = len(words & other) / union if union else 1.0
            if score >= threshold:
                found.append((prompt, original, score))
    return found


def build_prompts(
    counts: dict[str, int], held_out: Iterable[str], seed: int = 0
) -> list[tuple[str, str]]:
    """``(kind, prompt)`` for the kinds ``chat``, ``code`` and ``maths``, in kind order.

    Deterministic for a seed; near-duplicates of ``held_out`` are dropped before
    taking the first ``counts[kind]`` of each kind.
    """
    held_out = list(held_out)
    rng = random.Random(seed)
    pools = {
        "chat": chat_prompts(rng),
        "code": code_prompts(rng),
        "maths": maths_prompts(rng, counts.get("maths", 0) + 50),
    }
    out = []
    for kind, pool in pools.items():
        count = counts.get(kind, 0)
        bad = {p for p, _, _ in near_duplicates(pool, held_out)}
        chosen = [p for p in pool if p not in bad][:count]
        if len(chosen) < count:
            raise ValueError(f"only {len(chosen)} {kind} prompts, {count} asked for")
        out += [(kind, p) for p in chosen]
    return out
