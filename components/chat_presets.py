"""Content shipped with the app: system prompts and few-shot sets.

Shipped content may be shared across visitors even in isolation mode (see
``components.session``), so the demo still shows cross-request sharing.
"""

from __future__ import annotations

SYSTEM_PRESETS: dict[str, str] = {
    "Support agent": (
        "You are the support assistant of Northwind Outfitters, an online shop for hiking and camping gear.\n"
        "Policies you must follow:\n"
        "1. Orders ship within 2 business days from our warehouse in Denver, Colorado.\n"
        "2. Standard shipping is free on orders over $75; express shipping costs $15.\n"
        "3. Unused items can be returned within 60 days for a full refund; worn items within 30 days for store credit.\n"
        "4. Tents and sleeping bags carry a 2-year warranty against manufacturing defects.\n"
        "5. Never share a customer's personal data, and never promise delivery dates we cannot keep.\n"
        "6. If a question is not about our shop, politely steer the conversation back.\n"
        "Answer in two or three short, friendly sentences."
    ),
    "Concise tutor": (
        "You are a patient tutor for high-school students. Explain ideas simply, with one short example, "
        "and never more than three sentences."
    ),
    "Pirate": "You are a friendly pirate. Answer every question briefly, in pirate speak.",
}

DEFAULT_SYSTEM = "Support agent"
CUSTOM_SYSTEM = "Custom…"

# Questions the system prompt answers directly (the tiny model guesses less on those),
# per preset; the first preset's are the page's starters.
STARTERS_BY_PRESET: dict[str, list[str]] = {
    "Support agent": ["How long is the warranty on tents?", "How much is express shipping?",
                                    "Where do orders ship from?"],
    "Concise tutor": ["What is a prime number?", "Why is the sky blue?", "What does a verb do?"],
    "Pirate": ["Where is your ship?", "What do pirates eat?", "How do I find treasure?"],
}
STARTER_QUESTIONS = STARTERS_BY_PRESET[DEFAULT_SYSTEM]

FEW_SHOT_PRESETS: dict[str, dict] = {
    "Sentiment": {
        "instruction": "Classify the sentiment of each review as positive or negative.",
        "examples": [
            ("The battery lasts all day and the screen is gorgeous.", "positive"),
            ("It broke after two days and support never answered.", "negative"),
            ("Setup took five minutes and it just works.", "positive"),
            ("Way too loud, and the fan rattles constantly.", "negative"),
            ("Great value for the price, I would buy it again.", "positive"),
        ],
        "queries": ["The keyboard feels cheap and two keys stick.", "Fast shipping and it works perfectly.",
                    "Not worth the money at all.", "My kids love it and use it every day."],
    },
    "Translation (EN→FR)": {
        "instruction": "Translate English to French.",
        "examples": [
            ("Good morning.", "Bonjour."),
            ("Where is the train station?", "Où est la gare ?"),
            ("I would like a coffee, please.", "Je voudrais un café, s'il vous plaît."),
            ("Thank you very much.", "Merci beaucoup."),
        ],
        "queries": ["How much does this cost?", "The weather is nice today.", "I am looking for a hotel.",
                    "See you tomorrow."],
    },
    "Extraction": {
        "instruction": "Extract the person's name and city as JSON.",
        "examples": [
            ("Maria moved to Lisbon last spring.", '{"name": "Maria", "city": "Lisbon"}'),
            ("After college, Tom settled in Chicago.", '{"name": "Tom", "city": "Chicago"}'),
            ("Aiko has lived in Osaka her whole life.", '{"name": "Aiko", "city": "Osaka"}'),
        ],
        "queries": ["Pedro works as a chef in Madrid.", "Last year Fatima opened a bakery in Cairo.",
                    "Lena teaches piano in Vienna.", "Omar drives a taxi in Dubai."],
    },
}


def few_shot_prompt(instruction: str, examples: list[tuple[str, str]], query: str) -> str:
    """Static part first (instruction, examples), the per-request query last."""
    lines = [instruction.strip(), ""]
    for inp, out in examples:
        lines += [f"Input: {inp.strip()}", f"Output: {out.strip()}", ""]
    lines += [f"Input: {query.strip()}", "Output:"]
    return "\n".join(lines)


def few_shot_static_part(instruction: str, examples: list[tuple[str, str]]) -> str:
    """The text every query of a set shares (what the cache can reuse)."""
    full = few_shot_prompt(instruction, examples, "\x00")
    return full[: full.index("Input: \x00")]
