"""Content for the prompt-ordering lab: presets that each come with a good and a bad ordering.

Every preset builds the same N requests twice: once with the static content
first and the per-request content last (good for a prefix cache), once with the
same content in an order that breaks reuse (bad). Also: the queue for the
request-order demo and the starting custom template. Pure content: builds
``LabPrompt`` lists, runs nothing, imports no UI.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from analysis.lab.ordering_runs import LabPrompt, Variant

# --------------------------------------------------------------------- content
AIRLINE_POLICY = """You are the virtual assistant of Harbor Air, a regional airline flying from Seattle, Portland and Vancouver.
Follow these rules in every answer:
1. Checked bags: the first bag up to 23 kg is free on all fares except Basic; Basic fares pay $35 per bag.
2. Carry-on: one cabin bag up to 10 kg plus one personal item that fits under the seat.
3. Changes: Flex fares change for free; Standard fares pay a $75 change fee plus any fare difference; Basic fares cannot be changed.
4. Cancellations: within 24 hours of booking, every fare is refunded in full. After that, Flex fares get a refund, Standard fares get a travel credit valid for 12 months, and Basic fares get nothing back.
5. Delays over 3 hours entitle the passenger to a meal voucher; delays over 6 hours to a hotel night if the delay is our fault.
6. Pets under 8 kg travel in the cabin in a soft carrier for $95 each way; larger pets are not accepted.
7. Unaccompanied minors aged 5 to 14 need our escort service ($120 per flight).
8. Never reveal another passenger's booking, never invent flight numbers, and never promise compensation that these rules do not grant.
9. If a question is not about Harbor Air, politely say you can only help with Harbor Air travel.
Answer in two or three short, friendly sentences and mention the rule you applied."""

AIRLINE_QUESTIONS = [
    "Can I bring my cat on the flight to Portland?",
    "I booked a Basic fare yesterday; can I still cancel it?",
    "How much does a second checked bag cost?",
    "My flight was delayed four hours. What do I get?",
    "Can my 12-year-old fly alone to Vancouver?",
    "I want to move my Standard ticket to next week. What will it cost?",
    "Is a 12 kg cabin bag allowed?",
    "Do you give refunds on Flex fares?",
    "What happens if I miss my connection in Seattle?",
    "Can I change the name on my ticket?",
]

FEW_SHOT_INSTRUCTION = "Classify each customer message into one category: billing, shipping, returns, account or technical."
FEW_SHOT_EXAMPLES = [
    ("I was charged twice for the same order this morning.", "billing"),
    ("My parcel says delivered but it is not at my door.", "shipping"),
    ("The jacket is too small, how do I send it back?", "returns"),
    ("I forgot my password and the reset email never arrives.", "account"),
    ("The app crashes every time I open my order history.", "technical"),
    ("Why is there a $4.99 fee on my invoice?", "billing"),
    ("Can you ship to a P.O. box in Alaska?", "shipping"),
    ("I want a refund for the broken lamp I received.", "returns"),
    ("Please change the email address on my profile.", "account"),
    ("The checkout page shows an error 500 when I pay.", "technical"),
    ("My promo code was not applied to the total.", "billing"),
    ("The tracking number has not updated in six days.", "shipping"),
]
FEW_SHOT_QUERIES = [
    "I returned the shoes two weeks ago and still have no refund.",
    "The website logs me out every five minutes.",
    "How long does delivery to Canada take?",
    "My card was declined but the money left my account.",
    "I cannot find where to delete my account.",
    "The box arrived crushed and the glass inside is broken.",
    "Can I pay with a gift card and a credit card together?",
    "The courier left my package with a neighbour I do not know.",
    "The mobile app will not let me upload a photo of the receipt.",
    "Can I exchange a blue sweater for a red one?",
]

RAG_DOCS = [
    ("doc-1", "Solaris H10 home battery: overview",
     "The Solaris H10 stores 10 kWh and delivers up to 5 kW continuously. It mounts on a wall indoors or in a garage, "
     "weighs 98 kg and needs a dedicated 32 A circuit. One app controls up to four batteries."),
    ("doc-2", "Solaris H10: installation",
     "Installation must be done by a certified installer and takes about half a day. The battery needs 20 cm of "
     "free space on each side, an ambient temperature between -10 and 45 degrees Celsius, and a Wi-Fi or Ethernet "
     "connection for updates."),
    ("doc-3", "Solaris H10: warranty",
     "The warranty covers 10 years or 4,000 full cycles, whichever comes first, and guarantees 70 percent of the "
     "original capacity at the end. Damage from floods, fire or unauthorised repairs is not covered."),
    ("doc-4", "Solaris H10: backup power",
     "During a grid outage the H10 switches to backup power in under 20 milliseconds. In backup mode it powers "
     "essential circuits only: lights, the fridge, network equipment and outlets chosen at installation."),
    ("doc-5", "Solaris H10: app and tariffs",
     "The Solaris app shows charge level, solar production and home consumption in real time. Time-of-use mode "
     "charges the battery when electricity is cheap and discharges it during expensive peak hours."),
]
RAG_QUESTIONS = [
    "How long does the battery keep working during a power cut?",
    "Can I install the battery outside in winter?",
    "What does the warranty not cover?",
    "How heavy is the H10?",
    "Does the app show my solar production?",
    "Can I connect three batteries together?",
    "Who is allowed to install it?",
    "How much capacity is left after ten years?",
    "Will my fridge keep running in an outage?",
    "Can the battery save money with a time-of-use tariff?",
]

TOOLS = [
    {"name": "search_flights", "description": "Find flights between two airports on a date.",
     "parameters": {"origin": "IATA code", "destination": "IATA code", "date": "YYYY-MM-DD",
                    "cabin": "economy | business"}},
    {"name": "get_booking", "description": "Look up a booking by its confirmation code.",
     "parameters": {"confirmation_code": "6 letters", "last_name": "passenger last name"}},
    {"name": "change_booking", "description": "Move a booking to another flight; returns the fee and fare difference.",
     "parameters": {"confirmation_code": "6 letters", "new_flight": "flight number", "confirm": "true | false"}},
    {"name": "cancel_booking", "description": "Cancel a booking and return the refund or credit it gets.",
     "parameters": {"confirmation_code": "6 letters", "reason": "free text"}},
    {"name": "add_bag", "description": "Add a checked bag to a booking and return its price.",
     "parameters": {"confirmation_code": "6 letters", "weight_kg": "number"}},
    {"name": "flight_status", "description": "Current status, gate and delay of a flight.",
     "parameters": {"flight": "flight number", "date": "YYYY-MM-DD"}},
    {"name": "request_assistance", "description": "Book wheelchair, escort or medical assistance for a passenger.",
     "parameters": {"confirmation_code": "6 letters", "kind": "wheelchair | escort | medical"}},
]
TOOL_SYSTEM = ("You are Harbor Air's booking agent. When you need data or need to act, answer with exactly one "
               "JSON tool call like {\"tool\": NAME, \"arguments\": {...}}; otherwise answer briefly.")
TOOL_QUESTIONS = [
    "Is flight HA 212 on time today?",
    "Please add a 20 kg bag to booking QXRTZA.",
    "Find me a flight from Seattle to Portland on 2025-04-02.",
    "Cancel my booking LMNPQR, my trip is off.",
    "My grandmother needs a wheelchair on booking ZZTOPS.",
    "Move booking ABCDEF to flight HA 330.",
    "What's the status of my booking KJHGFD? Last name Moreau.",
    "Any business class seats from Vancouver to Seattle tomorrow?",
    "How much would a second bag cost on booking QWERTY?",
    "Which gate does HA 118 leave from?",
]

CHAT_SYSTEM = ("You are Trailhead, a friendly trip planner for the Pacific Northwest. You know national parks, "
               "ferries, trains and small towns between Seattle and Vancouver. Keep answers short and practical, "
               "suggest one concrete option at a time, and ask a follow-up question when the traveller's plans "
               "are unclear.")
CHAT_TURNS = [
    ("Hi! I have four days in early June and want to see mountains and the sea.",
     "Great season for that! Start with two days on the Olympic Peninsula: Hurricane Ridge for mountain views and "
     "Rialto Beach for sea stacks. Will you have a car?"),
    ("Yes, a rental car from Seattle. Where should I sleep the first night?",
     "Stay in Port Angeles: it is two and a half hours from Seattle with the Bainbridge ferry, and Hurricane Ridge "
     "is a 40-minute drive from town. Do you prefer a hotel or a campsite?"),
    ("A small hotel, please. What should I do on day two?",
     "Drive west to Lake Crescent for a morning paddle, hike the Marymere Falls trail, then continue to Rialto "
     "Beach for sunset. Sleep in Forks, about 20 minutes away."),
    ("Sounds good. And days three and four?",
     "On day three, visit the Hoh Rain Forest early, then drive back east and take the ferry from Port Townsend to "
     "Whidbey Island. Day four: Deception Pass in the morning and back to Seattle by the afternoon."),
    ("Do I need to book the Port Townsend ferry?",
     "Yes, reserve the Port Townsend to Coupeville crossing online a few days ahead in June: it is small and fills "
     "up. Arrive 30 minutes early even with a reservation."),
    ("Is there a park pass I should buy?",
     "For Olympic National Park buy the 7-day vehicle pass at the first entrance or online; if you visit three or "
     "more parks this year, the America the Beautiful annual pass is cheaper."),
    ("What should I pack for the rain forest?",
     "Pack a light rain jacket, waterproof shoes and a warm layer: the Hoh gets rain even in June and the trails "
     "stay muddy. Bring insect repellent for the evening."),
    ("Any good place to eat in Port Townsend?",
     "Try a waterfront seafood place for fish and chips, then an ice cream on Water Street before the ferry."),
]
CHAT_SUMMARIES = [  # [j]: a summary of the first j turns (index 0 unused)
    "",
    "The traveller has four days in early June and wants mountains and the sea. I suggested the Olympic "
    "Peninsula with Hurricane Ridge and Rialto Beach. They will rent a car in Seattle.",
    "Four-day June trip from Seattle by rental car. Plan so far: Olympic Peninsula; first night in Port Angeles "
    "near Hurricane Ridge; they prefer a small hotel.",
    "Traveller (June, 4 days, rental car, small hotels) will do Hurricane Ridge from Port Angeles on day one, then "
    "Lake Crescent, Marymere Falls and Rialto Beach on day two, sleeping in Forks.",
    "Itinerary: day 1 Port Angeles and Hurricane Ridge; day 2 Lake Crescent, Marymere Falls, Rialto Beach, night "
    "in Forks; day 3 Hoh Rain Forest then ferry Port Townsend to Whidbey; day 4 Deception Pass, back to Seattle.",
    "The trip plan is set (Olympic Peninsula, Hoh Rain Forest, Whidbey Island, Deception Pass). The traveller "
    "asked about the ferry: the Port Townsend to Coupeville crossing should be reserved days ahead in June.",
    "Four-day Olympic Peninsula and Whidbey Island trip in June with ferry reserved. Last question was about a park "
    "pass: a 7-day Olympic vehicle pass, or the annual pass if visiting three or more parks.",
]


# --------------------------------------------------------------------- builders
def _stamp(i: int) -> str:
    rid = hashlib.sha1(f"req-{i}".encode()).hexdigest()[:12]
    return f"Current time: 2025-03-14 09:{(12 + 3 * i) % 60:02d}:{(17 * i + 5) % 60:02d} UTC. Request id: {rid}."


def _pick(pool: list[str], i: int) -> str:
    return pool[i % len(pool)]


def timestamp_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    out = []
    for i in range(n):
        system = f"{AIRLINE_POLICY}\n\n{_stamp(i)}" if good else f"{_stamp(i)}\n\n{AIRLINE_POLICY}"
        out.append(LabPrompt(f"request {i + 1}", messages=({"role": "system", "content": system},
                                                           {"role": "user", "content": _pick(AIRLINE_QUESTIONS, i)})))
    return tuple(out)


def few_shot_block(examples: list[tuple[str, str]], query: str) -> str:
    lines = [FEW_SHOT_INSTRUCTION, ""]
    for text, label in examples:
        lines += [f"Message: {text}", f"Category: {label}", ""]
    lines += [f"Message: {query}", "Category:"]
    return "\n".join(lines)


def few_shot_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    out = []
    for i in range(n):
        examples = list(FEW_SHOT_EXAMPLES)
        if not good:
            random.Random(1000 + i).shuffle(examples)  # a new order on every request
        out.append(LabPrompt(f"request {i + 1}", messages=(
            {"role": "system", "content": "You are a precise ticket classifier. Answer with the category only."},
            {"role": "user", "content": few_shot_block(examples, _pick(FEW_SHOT_QUERIES, i))})))
    return tuple(out)


def _docs_text(docs: list[tuple[str, str, str]]) -> str:
    return "\n\n".join(f"[{d_id}] {title}\n{body}" for d_id, title, body in docs)


_RAG_SYSTEM = "You answer questions about the Solaris H10 home battery using only the documents given. Cite them."


def rag_position_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    out = []
    for i in range(n):
        docs, q = _docs_text(RAG_DOCS), _pick(RAG_QUESTIONS, i)
        user = (f"Documents:\n{docs}\n\nQuestion: {q}" if good else f"Question: {q}\n\nDocuments:\n{docs}")
        out.append(LabPrompt(f"request {i + 1}", messages=({"role": "system", "content": _RAG_SYSTEM},
                                                           {"role": "user", "content": user})))
    return tuple(out)


def doc_scores(i: int) -> list[float]:
    """A retriever's relevance score of each document for request ``i`` (deterministic)."""
    rng = random.Random(500 + i)
    return [round(rng.random(), 3) for _ in RAG_DOCS]


def rag_order_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    out = []
    for i in range(n):
        scores = doc_scores(i)
        order = range(len(RAG_DOCS)) if good else sorted(range(len(RAG_DOCS)), key=lambda d: -scores[d])
        docs = _docs_text([RAG_DOCS[d] for d in order])
        user = f"Documents:\n{docs}\n\nQuestion: {_pick(RAG_QUESTIONS, i)}"
        out.append(LabPrompt(f"request {i + 1}", messages=({"role": "system", "content": _RAG_SYSTEM},
                                                           {"role": "user", "content": user})))
    return tuple(out)


def _tools_text() -> str:
    return "Available tools:\n" + "\n".join(json.dumps(t) for t in TOOLS)


def tool_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    out = []
    for i in range(n):
        q = {"role": "user", "content": _pick(TOOL_QUESTIONS, i)}
        if good:
            msgs = ({"role": "system", "content": f"{TOOL_SYSTEM}\n\n{_tools_text()}"}, q)
        else:
            msgs = ({"role": "system", "content": TOOL_SYSTEM}, q, {"role": "system", "content": _tools_text()})
        out.append(LabPrompt(f"request {i + 1}", messages=msgs))
    return tuple(out)


def chat_prompts(n: int, good: bool) -> tuple[LabPrompt, ...]:
    """Good: the whole history verbatim, so each turn extends the last prompt.
    Bad: a fresh summary of the older turns on every turn, then the last exchange
    verbatim: the summary changes, so everything after it is computed again."""
    out = []
    for k in range(min(n, len(CHAT_TURNS))):
        msgs: list[dict] = [{"role": "system", "content": CHAT_SYSTEM}]
        verbatim = CHAT_TURNS[:k] if good or k < 2 else CHAT_TURNS[k - 1:k]
        if not good and k >= 2:
            msgs += [{"role": "user", "content": f"Summary of our conversation so far: {CHAT_SUMMARIES[k - 1]}"},
                     {"role": "assistant", "content": "Thanks, I have the context. Go on."}]
        for user, reply in verbatim:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        msgs.append({"role": "user", "content": CHAT_TURNS[k][0]})
        out.append(LabPrompt(f"turn {k + 1}", messages=tuple(msgs)))
    return tuple(out)


# --------------------------------------------------------------------- presets
@dataclass(frozen=True)
class OrderingPreset:
    title: str
    what: str  # one line: what differs between the two orderings
    good_name: str
    bad_name: str
    build: Callable[[int, bool], tuple[LabPrompt, ...]]
    max_requests: int = 10

    def variants(self, n: int) -> list[Variant]:
        n = max(1, min(int(n), self.max_requests))
        return [Variant(self.good_name, self.build(n, True)), Variant(self.bad_name, self.build(n, False))]


PRESETS: dict[str, OrderingPreset] = {p.title: p for p in [
    OrderingPreset("Timestamp in the system prompt",
                   "A long system prompt with the current time and a request id: at its end, or at its top.",
                   "Good: time and id at the end", "Bad: time and id at the top", timestamp_prompts),
    OrderingPreset("Few-shot example order",
                   "Twelve classification examples before the query: in one fixed order, or shuffled per request.",
                   "Good: fixed example order", "Bad: examples shuffled per request", few_shot_prompts),
    OrderingPreset("RAG: documents vs question",
                   "The same retrieved documents and a new question: documents first, or the question first.",
                   "Good: documents, then question", "Bad: question, then documents", rag_position_prompts),
    OrderingPreset("RAG: document order",
                   "The same five documents before the question: in a stable order, or sorted by each "
                   "request's relevance score.",
                   "Good: stable document order", "Bad: per-request score order", rag_order_prompts),
    OrderingPreset("Tool list placement",
                   "Seven tool definitions: in the system prompt before the conversation, or appended after it.",
                   "Good: tools first", "Bad: tools after the conversation", tool_prompts),
    OrderingPreset("Multi-turn chat history",
                   "A conversation, turn after turn: the history kept verbatim, or re-summarised every turn.",
                   "Good: history verbatim", "Bad: history re-summarised each turn", chat_prompts,
                   max_requests=len(CHAT_TURNS)),
]}
DEFAULT_PRESET = "Timestamp in the system prompt"


def scheduling_queue(per_group: int = 3, groups: int = 3) -> tuple[LabPrompt, ...]:
    """A burst of requests from ``groups`` workloads (each sharing a long prefix),
    arriving interleaved: A1 B1 C1 A2 B2 C2 ... The request-order demo's queue."""
    builders = [("A", timestamp_prompts), ("B", few_shot_prompts), ("C", rag_position_prompts), ("D", tool_prompts)]
    builders = builders[:max(1, min(groups, len(builders)))]
    columns = [[LabPrompt(f"{letter}{i + 1}", p.messages, p.prompt) for i, p in enumerate(build(per_group, True))]
               for letter, build in builders]
    return tuple(p for row in zip(*columns, strict=True) for p in row)


# --------------------------------------------------------------------- custom template
CUSTOM_TEMPLATE = """Request {request_id} received at {time}.
You are the assistant of Harbor Air. Checked bags: the first bag up to 23 kg is free except on Basic fares, which pay $35 per bag. Flex fares change for free; Standard fares pay a $75 change fee; Basic fares cannot be changed. Within 24 hours of booking every fare is refunded in full. Pets under 8 kg travel in the cabin for $95 each way. Answer in two short sentences.
Customer question: {question}
Answer:"""

CUSTOM_VALUES = "\n".join(json.dumps({"request_id": rid, "time": t, "question": q}) for rid, t, q in [
    ("r-1041", "09:12:05", "Can I bring my cat?"),
    ("r-1042", "09:12:40", "Is my Basic fare refundable after two days?"),
    ("r-1043", "09:13:02", "How much is a checked bag on a Basic fare?"),
    ("r-1044", "09:13:31", "Can I change a Flex ticket?"),
    ("r-1045", "09:14:10", "I booked an hour ago, can I get my money back?"),
    ("r-1046", "09:14:52", "What does a Standard fare change cost?"),
])
