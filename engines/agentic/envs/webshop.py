"""A WebShop-shaped shopping environment, offline: generated catalogue, WebShop's actions and reward.

WebShop (Yao, Chen, Yang, Narasimhan 2022, "WebShop: Towards Scalable Real-World Web Interaction
with Grounded Language Agents", arXiv 2207.01206) needs its scraped catalogue (1.18 M products)
and a search engine, which cannot be fetched here. This environment keeps its shape:

- **Catalogue** (``make_catalogue(seed)``, the same for the same seed): products of 4 categories ×
  4 types, each with a made-up brand, 2-3 attributes from its category's list (``waterproof``,
  ``machine washable``, ...), which also appear in its title, 2-3 option kinds (size, color, pack)
  with 2-4 values each, a price, and WebShop's ``product_category`` path and ``query``.
- **Instruction** (``reset(seed)``): a target product, 1-2 of its attributes, one value of each of
  its option kinds and a price bound drawn as WebShop's synthetic goals draw it (two of the four
  multiples of 10 above the price, the larger one), written as WebShop writes it: "i am looking
  for waterproof hiking boots with size: 9, and color: black, and price lower than 60.00 dollars".
- **Pages and actions** (WebShop's text mode): the search page takes ``search[query]``; the results
  page lists ``page_size`` products (id, title, price; WebShop shows 10) of the first 50 hits
  ranked by query-word overlap, with ``click[<id>]``, ``click[next >]``, ``click[< prev]``,
  ``click[back to search]``; the item page shows price, attributes and options, takes
  ``click[<option value>]`` (selects it), ``click[< prev]``, ``click[back to search]`` and
  ``click[buy now]``, which ends the episode. ``(...)`` is accepted for ``[...]`` everywhere, and
  ``brackets="()"`` renders the hints that way, so all text is in the tiny policy's characters.
- **Reward** on ``buy now``, WebShop's (``web_agent_site/engine/goal.py`` ``get_reward``):

      r = r_type · (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price ≤ u_price]) / (|U_att| + |U_opt| + 1)

  U the instruction's attributes, options and price bound; Y the bought product's attributes (an
  attribute also counts when its words are in the title), the options selected (a value also
  counts when it is in the title) and price. ``r_type`` from title / category / query matching:
  title_score = |nouns(Y title) ∩ nouns(U title)| / |nouns(U title)|; r_type = 1, or 0.5 when
  neither query, category (≥ 2 shared levels) nor title (score > 0.2) match, 0.1 when
  title_score < 0.1, 0 when it is 0. Departures: exact string matching where WebShop uses
  ``thefuzz`` (> 85) and spaCy nouns — the catalogue is generated, so its nouns are known (brand
  and type words). ``info["success"]`` is r = 1.

A step that is not one of the page's actions is invalid (``invalid_penalty``, page unchanged, the
observation starts ``invalid``). Episodes take 5-10 actions for the teacher (search, 0-4 page
turns, the item, 2-3 options, buy); ``solve()`` is that teacher (privileged: it knows the target),
re-planning from any page, for the bootstrap corpus (``solved_episodes``).

``reward`` is what ``buy now`` pays: ``"score"`` (the default) is WebShop's ``r`` above; ``"success"``
pays 1 when ``r`` is 1 and 0 otherwise, for RL whose target is the success rate: under the score, a
purchase that misses one requested value still earns 0.75-0.8, and a policy that stops before its last
option click loses little. ``info["score"]`` is ``r`` in both, and the final observation prints it.

``teacher_browses`` (off by default) makes its choice of item one the policy can make too. The
privileged teacher pages straight to the first hit that earns reward 1, but a results page shows
titles and prices, not options, so a policy copying it learns to guess. The browsing teacher opens,
in ranking order, the hits whose title (type, attributes) and price fit the instruction and that it
has not opened yet (``opened``), and clicks ``< prev`` on an item page without the requested
values. Seeds 0-199 with ``page_size=3``: reward 1 on all, 5-15 actions (186 within 10), 79 going
back at least once.

``teacher_option_rate`` (1.0 by default) shapes only that teacher: on that share of seeds (drawn
from the seed, so the same seeds every time) it selects the instruction's options before buying; on
the others it opens the same product and buys it at once, earning WebShop's partial score (every
point but the options'). ``teacher_finished`` keeps both kinds of episode in the bootstrap corpus. A
policy warm-started on them skips the options on some instructions, which is WebShop's commonest
failure (option matching), and RL has to teach it that choosing them pays (as ``tool_table``'s
``teacher_tool_rate`` does for the calculator). The episodes themselves do not change. One SmolLM2
run with it (0.5) did not rise in 6 iterations (docs/agentic.md, "WebShop with SmolLM2").
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass

from engines.agentic.envs.base import INVALID_PENALTY, step_info, teacher_lapses, teacher_rate

CATEGORIES = {   # category -> (group, types, attributes, option kinds)
    "clothing": ("shoes", ["hiking boots", "running shoes", "rain jacket", "wool socks"],
                 ["waterproof", "lightweight", "breathable", "machine washable", "non slip", "quick dry"],
                 ["size", "color"]),
    "home": ("kitchen", ["coffee mug", "throw pillow", "desk lamp", "bath towel"],
             ["dishwasher safe", "handmade", "eco friendly", "soft", "easy clean", "durable"],
             ["color", "pack"]),
    "electronics": ("accessories", ["phone case", "usb cable", "wireless earbuds", "laptop stand"],
                    ["fast charging", "shockproof", "noise cancelling", "portable", "durable", "slim"],
                    ["color", "pack", "length"]),
    "beauty": ("personal care", ["face cream", "hair shampoo", "body lotion", "lip balm"],
               ["organic", "fragrance free", "paraben free", "long lasting", "vegan", "sensitive skin"],
               ["size", "scent"]),
}
OPTION_VALUES = {
    "size": {"clothing": ["small", "medium", "large", "x large"], "beauty": ["2 ounce", "4 ounce", "8 ounce"]},
    "color": ["black", "white", "navy blue", "red", "grey", "green"],
    "pack": ["pack of 1", "pack of 2", "pack of 4"],
    "length": ["3 feet", "6 feet", "10 feet"],
    "scent": ["lavender", "vanilla", "unscented", "citrus"],
}
BRANDS = ["acme", "norla", "vexo", "kindra", "tamsy", "brivo", "olmec", "zendi", "pluma", "rovik"]
PRICE_RANGE = [10.0 * i for i in range(1, 100)]     # WebShop goal.py's price bounds
MAX_HITS = 50                                        # WebShop's search returns the top 50
REWARDS = ("score", "success")                       # what buy now pays: WebShop's score, or 1 for a full score


@dataclass(frozen=True)
class Product:
    asin: str
    title: str
    brand: str
    type: str                                # WebShop's "query" the product was found with
    category: tuple[str, str, str]           # product_category, e.g. (clothing, shoes, hiking boots)
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]   # (kind, values) in display order
    price: float

    @property
    def nouns(self) -> set[str]:
        """The title's nouns (brand and type words): what WebShop's spaCy parse keeps for r_type."""
        return {self.brand, *self.type.split()}

    def text(self) -> str:
        return " ".join([self.title, *self.attributes, *self.category])


@dataclass(frozen=True)
class Goal:
    asin: str
    attributes: tuple[str, ...]
    options: tuple[str, ...]                 # one value per option kind of the target
    price_upper: float
    instruction: str


def make_catalogue(seed: int = 0, per_type: int = 24) -> list[Product]:
    """``per_type`` products of each of the 16 types, the same for the same ``seed``."""
    rng = random.Random(f"catalogue-{seed}")
    products = []
    for cat in sorted(CATEGORIES):
        group, types, attrs, kinds = CATEGORIES[cat]
        for typ in types:
            for _ in range(per_type):
                brand = rng.choice(BRANDS)
                chosen = tuple(rng.sample(attrs, rng.randint(2, 3)))
                options = []
                for kind in kinds:
                    pool = OPTION_VALUES[kind]
                    pool = pool[cat] if isinstance(pool, dict) else pool
                    options.append((kind, tuple(sorted(rng.sample(pool, rng.randint(2, min(4, len(pool))))))))
                asin = "b0" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
                price = round(rng.uniform(5, 95), 2)
                products.append(Product(asin, f"{brand} {' '.join(chosen)} {typ}", brand, typ, (cat, group, typ),
                                        chosen, tuple(options), price))
    return products


def make_goal(product: Product, rng: random.Random) -> Goal:
    """An instruction for ``product``, as WebShop's ``get_synthetic_goals`` phrases one."""
    attrs = tuple(rng.sample(product.attributes, rng.randint(1, 2)))
    options = tuple(rng.choice(values) for _, values in product.options)
    above = [p for p in PRICE_RANGE if p > product.price][:4]
    price_upper = sorted(rng.sample(above, 2))[1] if len(above) >= 2 else 1_000_000.0
    option_text = ", and ".join(f"{kind}: {v}" for (kind, _), v in zip(product.options, options))
    text = f"i am looking for {' and '.join(attrs)} {product.type} with {option_text}, and price lower than {price_upper:.2f} dollars"
    return Goal(product.asin, attrs, options, price_upper, text)


def webshop_reward(product: Product, goal: Goal, target: Product, selected: dict[str, str]) -> tuple[float, dict]:
    """WebShop's ``get_reward`` (see the module docstring) for buying ``product`` with ``selected``
    options when ``goal`` (for ``target``) was asked. Returns (r, parts)."""
    query_match = product.type == target.type
    category_match = len(set(product.category) & set(target.category)) >= 2
    title_score = len(product.nouns & target.nouns) / len(target.nouns)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    n_att = sum(a in product.attributes or a in product.title for a in goal.attributes)
    n_opt = sum(v in goal.options or v in product.title for v in selected.values())
    r_price = float(product.price <= goal.price_upper)
    r = r_type * (n_att + n_opt + r_price) / (len(goal.attributes) + len(goal.options) + 1)
    return r, {"r_type": r_type, "title_score": title_score, "attribute_matches": n_att, "option_matches": n_opt,
               "price_ok": bool(r_price)}


def search(products: list[Product], query: str) -> list[Product]:
    """The top ``MAX_HITS`` products by the number of query words in their text (title, attributes,
    category path); ties keep catalogue order. Products sharing no word are not hits."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    scored = []
    for i, p in enumerate(products):
        score = len(words & set(p.text().split()))
        if score:
            scored.append((-score, i, p))
    return [p for _, _, p in sorted(scored)[:MAX_HITS]]


_ACTION = re.compile(r"^\s*(search|click)\s*[\[(]\s*(.*?)\s*[\])]\s*$", re.IGNORECASE)


def parse_action(text: str) -> tuple[str, str] | None:
    """(``search``|``click``, argument lower-cased) from the first non-empty line, or None."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    m = _ACTION.match(line)
    return (m.group(1).lower(), " ".join(m.group(2).lower().split())) if m else None


class WebShop:
    name = "webshop"

    def __init__(self, catalogue_seed: int = 0, per_type: int = 24, page_size: int = 10, brackets: str = "[]",
                 invalid_penalty: float = INVALID_PENALTY, repeat_instruction: bool = True,
                 teacher_option_rate: float = 1.0, teacher_browses: bool = False, reward: str = "score"):
        if page_size < 1 or brackets not in ("[]", "()") or reward not in REWARDS:
            raise ValueError(f"webshop: page_size={page_size} (>= 1), brackets={brackets!r} ('[]' or '()'), "
                             f"reward={reward!r} ({' or '.join(map(repr, REWARDS))})")
        self.reward = reward
        self.teacher_option_rate = teacher_rate("webshop", "teacher_option_rate", teacher_option_rate)
        self.teacher_browses = bool(teacher_browses)
        self.products = make_catalogue(catalogue_seed, per_type)
        self.by_asin = {p.asin: p for p in self.products}
        self.page_size, self.invalid_penalty, self.repeat_instruction = page_size, invalid_penalty, repeat_instruction
        self.open, self.close = brackets
        self.instructions = (f"webshop: buy the product the instruction asks for. actions: search{self.open}query{self.close}, "
                             f"click{self.open}item id, option, next >, < prev, back to search or buy now{self.close}.\n")
        self.goal: Goal | None = None
        self.seed = 0
        self.page, self.query, self.page_no, self.asin = "search", "", 0, ""
        self.hits: list[Product] = []
        self.selected: dict[str, str] = {}
        self.opened: list[str] = []          # item ids opened this episode, in order
        self.done = False

    # ------------------------------------------------------------------ protocol
    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.seed = seed
        self.goal = make_goal(rng.choice(self.products), rng)
        self.page, self.query, self.page_no, self.asin, self.hits, self.selected = "search", "", 0, "", [], {}
        self.opened, self.done = [], False
        return f"instruction: {self.goal.instruction}\n" + self.render(head=False)

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return self._invalid("the episode is over")
        parsed = parse_action(action_text)
        if parsed is None:
            return self._invalid(f"expected search{self.open}...{self.close} or click{self.open}...{self.close}")
        verb, arg = parsed
        before = self.state_key()
        if verb == "search":
            if self.page != "search":
                return self._invalid("search only on the search page (click back to search)")
            if not arg:
                return self._invalid("empty search")
            self.query, self.hits, self.page, self.page_no = arg, search(self.products, arg), "results", 0
        elif arg == "back to search" and self.page != "search":
            self.page, self.query, self.hits, self.page_no, self.asin, self.selected = "search", "", [], 0, "", {}
        elif self.page == "results":
            if arg == "next >" and (self.page_no + 1) * self.page_size < len(self.hits):
                self.page_no += 1
            elif arg == "< prev" and self.page_no > 0:
                self.page_no -= 1
            elif arg in {p.asin for p in self._shown()}:
                self.page, self.asin, self.selected = "item", arg, {}
                self.opened.append(arg)
            else:
                return self._invalid("that is not clickable on this page")
        elif self.page == "item":
            product = self.by_asin[self.asin]
            kind = next((k for k, values in product.options if arg in values), None)
            if arg == "< prev":
                self.page, self.asin, self.selected = "results", "", {}
            elif kind is not None:
                self.selected[kind] = arg
            elif arg == "buy now":
                self.done = True
                score, parts = webshop_reward(product, self.goal, self.by_asin[self.goal.asin], self.selected)
                success = score >= 1.0 - 1e-9
                r = score if self.reward == "score" else float(success)
                said = f"reward {r:.2f}" + ("" if self.reward == "score" else f" (webshop score {score:.2f})")
                return (f"you bought {product.title}. {said}\n", r, True,
                        step_info(True, True, success, score=score, **parts))
            else:
                return self._invalid("that is not clickable on this page")
        else:
            return self._invalid("that is not clickable on this page")
        return self.render(), 0.0, False, step_info(True, self.state_key() != before, False)

    def state_key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.selected.items()))
        return f"{self.page}|{self.query}|{self.page_no}|{self.asin}|{opts}"

    def solve(self) -> list[str] | None:
        """The teacher's actions from here: search the instruction's attributes and type, page to the
        first hit that earns the full reward (``teacher_browses``: open the hits that look right in
        turn, going back from those without the requested values), open it, select the goal's options
        (unless this seed is one ``teacher_option_rate`` leaves out), buy. Returns None when it does not finish
        (``teacher_finished``) within 30 actions."""
        env, actions = self._clone(), []
        for _ in range(30):
            if env.done:
                break
            action = env._teacher_action()
            actions.append(action)
            _, r, done, info = env.step(action)
            if done:
                return actions if env.teacher_finished(info) else None
        return None

    def teacher_finished(self, info: dict) -> bool:
        """Whether the step that returned ``info`` ended the episode as the teacher means to: with
        reward 1, or, on a seed where it skips the options, with a product of the right type that
        matches every attribute and the price (all but the options' points)."""
        if info.get("success"):
            return True
        return (self.done and self._teacher_skips_options() and info.get("r_type") == 1.0
                and info.get("attribute_matches") == len(self.goal.attributes) and bool(info.get("price_ok")))

    def _teacher_skips_options(self) -> bool:
        return teacher_lapses(self.seed, self.teacher_option_rate)

    def _clone(self) -> "WebShop":
        """A copy of the episode state sharing the (immutable) catalogue."""
        env = copy.copy(self)
        env.hits, env.selected, env.opened = list(self.hits), dict(self.selected), list(self.opened)
        return env

    # ------------------------------------------------------------------ teacher
    def _fits(self, p: Product) -> bool:
        """Buying ``p`` with the goal's options earns reward 1."""
        chosen = {k: v for k, values in p.options for v in values if v in self.goal.options}
        return webshop_reward(p, self.goal, self.by_asin[self.goal.asin], chosen)[0] >= 1.0 - 1e-9

    def _looks_right(self, p: Product) -> bool:
        """What a results page shows of ``p`` fits the instruction: the instruction's type and
        attributes in its title, its price under the bound. Its options show only on its own page."""
        return (p.type == self.by_asin[self.goal.asin].type and p.price <= self.goal.price_upper
                and all(a in p.title for a in self.goal.attributes))

    def _teacher_action(self) -> str:
        a = lambda verb, arg: f"{verb}{self.open}{arg}{self.close}"  # noqa: E731
        target = self.by_asin[self.goal.asin]
        if self.page == "search":
            return a("search", " ".join(self.goal.attributes) + " " + target.type)
        if self.page == "item":
            p = self.by_asin[self.asin]
            if not self._fits(p):
                return a("click", "< prev")
            for kind, values in ([] if self._teacher_skips_options() else p.options):
                want = next((v for v in values if v in self.goal.options), None)
                if want is not None and self.selected.get(kind) != want:
                    return a("click", want)
            return a("click", "buy now")
        if self.teacher_browses:   # the first hit that looks right and was not opened yet: what the pages show
            first = next((i for i, p in enumerate(self.hits) if self._looks_right(p) and p.asin not in self.opened), None)
        else:                      # the first hit that earns reward 1: the teacher knows every product's options
            first = next((i for i, p in enumerate(self.hits) if self._fits(p)), None)
        if first is None:
            return a("click", "back to search")
        page = first // self.page_size
        if page > self.page_no:
            return a("click", "next >")
        if page < self.page_no:
            return a("click", "< prev")
        return a("click", self.hits[first].asin)

    # ------------------------------------------------------------------ text
    def _shown(self) -> list[Product]:
        return self.hits[self.page_no * self.page_size:(self.page_no + 1) * self.page_size]

    def _invalid(self, why: str) -> tuple[str, float, bool, dict]:
        obs = f"invalid: {why}\n" + ("" if self.done else self.render())
        return obs, self.invalid_penalty, self.done, step_info(False, False, False, error=why)

    def render(self, head: bool | None = None) -> str:
        """The current page; with the instruction on top when ``head`` (default: ``repeat_instruction``,
        as WebShop shows it on every page; the first observation always has it)."""
        head = f"instruction: {self.goal.instruction}\n" if (self.repeat_instruction if head is None else head) else ""
        if self.page == "search":
            return head + f"search page. type search{self.open}your query{self.close}\naction: "
        if self.page == "results":
            pages = max(1, -(-len(self.hits) // self.page_size))
            lines = [f"results for {self.query}: page {self.page_no + 1} of {pages} ({len(self.hits)} results)"]
            lines += [f"{p.asin}: {p.title}, price {p.price:.2f}" for p in self._shown()]
            lines.append("click: " + ", ".join(["back to search"] + (["< prev"] if self.page_no else [])
                                               + (["next >"] if self.page_no + 1 < pages else []) + ["an item id"]))
            return head + "\n".join(lines) + "\naction: "
        p = self.by_asin[self.asin]
        lines = [f"{p.asin}: {p.title}", f"price: {p.price:.2f}", "attributes: " + ", ".join(p.attributes)]
        for kind, values in p.options:
            chosen = self.selected.get(kind)
            lines.append(f"{kind}: " + ", ".join(values) + (f" (selected: {chosen})" if chosen else ""))
        lines.append("click: back to search, < prev, an option, buy now")
        return head + "\n".join(lines) + "\naction: "
