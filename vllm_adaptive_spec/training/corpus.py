"""The training prompt corpus, generated from templates (never the benchmark set).

Seven task families mirror the benchmark categories so the head sees the same
kinds of answers: explanations (qa), code, arithmetic word problems, chat
advice, translation, and two families built on passages (summarization and
questions over a passage). The passages are the target's own stage-1 answers,
so the second stage is written only after the first is answered.
"""

from __future__ import annotations

import random

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "solar panels", "wind turbines", "nuclear fission", "electric cars",
    "the internet", "public key cryptography", "machine learning", "neural networks", "databases", "compilers",
    "operating systems", "cloud computing", "the French Revolution", "the Roman Empire", "the printing press",
    "the industrial revolution", "the Silk Road", "ancient Egypt", "the Renaissance", "the Cold War",
    "inflation", "interest rates", "supply and demand", "stock markets", "budgeting", "compound interest",
    "sleep", "nutrition", "exercise", "meditation", "coffee", "tea", "bread baking", "composting",
    "honeybees", "coral reefs", "rainforests", "deserts", "volcanoes", "earthquakes", "hurricanes",
    "the moon", "Mars", "the solar system", "stars", "galaxies", "gravity", "magnetism", "electricity",
    "sound waves", "light", "rainbows", "DNA", "evolution", "cells", "bacteria", "viruses", "antibiotics",
    "the heart", "the brain", "memory", "language learning", "music theory", "jazz", "chess", "football",
    "the Olympics", "photography", "painting", "poetry", "novels", "libraries", "museums", "democracy",
    "elections", "taxes", "urban planning", "public transport", "bicycles", "airplanes", "trains", "ships",
    "bridges", "skyscrapers", "recycling", "plastic pollution", "oceans", "glaciers", "rivers", "forests",
    "birds", "cats", "dogs", "whales", "ants", "mushrooms", "gardening", "tomatoes", "rice", "chocolate",
    "cheese", "spices", "time zones", "calendars", "maps", "GPS", "batteries", "semiconductors", "lasers",
    "robots", "3D printing", "smartphones", "email", "password managers", "open source software",
)

EXPLAIN = (
    "Explain {t} in simple terms.",
    "What is the most important thing to know about {t}?",
    "Give me a short overview of {t}.",
    "Why does {t} matter? Answer in a few sentences.",
    "List five interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are common misconceptions about {t}?",
    "Describe the history of {t} briefly.",
    "What are the pros and cons of {t}?",
    "Write a short paragraph about {t}.",
)

CODE_TASKS = (
    "reverses a string", "counts the vowels in a string", "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome", "merges two sorted lists", "removes duplicates from a list",
    "computes the factorial of a number", "finds the largest element of a list", "sorts a list with bubble sort",
    "computes the greatest common divisor of two numbers", "converts Celsius to Fahrenheit",
    "counts word frequencies in a text", "flattens a nested list", "checks whether a year is a leap year",
    "returns the prime numbers below n", "computes the average of a list of numbers",
    "capitalizes every word of a sentence", "finds the second smallest number in a list",
    "reads a CSV file and prints each row", "implements binary search", "transposes a matrix",
    "checks whether two strings are anagrams", "returns the sum of the digits of an integer",
    "implements a simple stack class", "validates an email address with a regular expression",
)
LANGUAGES = ("Python", "JavaScript", "C", "Java", "Go", "Rust", "Python", "Python")
CODE = (
    "Write a {lang} function that {task}.",
    "Show me how to write a {lang} program that {task}, with comments.",
    "Implement, in {lang}, a function that {task}, and explain how it works.",
)

NAMES = ("Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kate", "Liam")
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "tickets", "coins", "cards", "eggs")
MATH = (
    "{a} has {x} {item}. {b} gives {a} {y} more, then {a} gives away {z}. How many {item} does {a} have now?",
    "A box holds {x} {item}. How many {item} are there in {y} boxes?",
    "{a} buys {x} {item} at {y} dollars each and pays with a {z}0-dollar bill. How much change does {a} get?",
    "What is {x} times {y} plus {z}? Show your steps.",
    "{a} reads {x} pages a day. How many days does a {y}00-page book take?",
    "A train travels {x}0 km in {y} hours. What is its average speed?",
    "Solve for n: {x}n + {y} = {z}{x}.",
    "What is {x} percent of {y}00?",
)

CHAT = (
    "I want to get better at {t}. Where should I start?",
    "My friend says {t} is boring. How can I convince them otherwise?",
    "I have a presentation about {t} tomorrow. Can you help me plan it?",
    "Can you recommend a weekend project related to {t}?",
    "I'm writing a blog post about {t}. Suggest a title and an outline.",
)

PHRASES = (
    "Good morning, how are you today?", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "The weather is beautiful today.", "Can you help me find my keys?", "We are going to the beach this weekend.",
    "This book is very interesting.", "What time does the museum open?", "My brother lives in a big city.",
    "Thank you very much for your help.", "I am learning to cook Italian food.", "The meeting starts at nine o'clock.",
    "How much does this jacket cost?", "Please close the window, it is cold.", "She plays the piano every evening.",
)
TARGET_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
TRANSLATE = (
    "Translate into {lang}: \"{s}\"",
    "How do you say \"{s}\" in {lang}?",
)

SUMMARIZE = (
    "Summarize the following text in two sentences.\n\n{passage}",
    "Rewrite the following text as a bulleted list of key points.\n\n{passage}",
    "Here is a text:\n\n{passage}\n\nGive it a title and a one-sentence summary.",
)
PASSAGE_QA = (
    "Read the passage and answer the question.\n\nPassage: {passage}\n\nQuestion: What is the main idea of the passage?",
    "Passage: {passage}\n\nUsing only the passage above, list the facts it states about {t}.",
    "Context: {passage}\n\nQuote the sentence of the context that best explains {t}, then explain it.",
)


def first_stage(count: int, seed: int = 0) -> list[dict]:
    """``count`` prompts of the five passage-free families, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for t in TOPICS:
        for template in EXPLAIN:
            prompts.append(("qa", template.format(t=t)))
        for template in CHAT:
            prompts.append(("chat", template.format(t=t)))
    for task in CODE_TASKS:
        for lang in LANGUAGES:
            prompts.append(("code", rng.choice(CODE).format(lang=lang, task=task)))
    for _ in range(300):
        a, b = rng.sample(NAMES, 2)
        template = rng.choice(MATH)
        text = template.format(a=a, b=b, item=rng.choice(ITEMS), x=rng.randint(2, 40), y=rng.randint(2, 12),
                               z=rng.randint(1, 9))
        prompts.append(("math", text))
    for s in PHRASES:
        for lang in TARGET_LANGUAGES:
            prompts.append(("translation", rng.choice(TRANSLATE).format(lang=lang, s=s)))
    rng.shuffle(prompts)
    return [_record(f"s1-{i:05d}", category, text) for i, (category, text) in enumerate(prompts[:count])]


def second_stage(answered: list[dict], count: int, seed: int = 1) -> list[dict]:
    """Passage prompts over the target's own qa answers (``topic`` is recovered
    from the prompt, so it reads naturally in the question)."""
    rng = random.Random(seed)
    sources = [a for a in answered if a["category"] == "qa" and len(a["answer"]) > 200]
    rng.shuffle(sources)
    prompts = []
    for i, source in enumerate(sources[:count]):
        topic = next((t for t in TOPICS if t in source["prompt"]), "the subject")
        if i % 2:
            text = rng.choice(SUMMARIZE).format(passage=source["answer"].strip())
            category = "summarization"
        else:
            text = rng.choice(PASSAGE_QA).format(passage=source["answer"].strip(), t=topic)
            category = "rag"
        prompts.append(_record(f"s2-{i:05d}", category, text))
    return prompts


def _record(prompt_id: str, category: str, text: str) -> dict:
    return {"id": prompt_id, "category": category, "prompt": text}
