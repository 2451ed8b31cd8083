"""engines/agentic/envs/webshop.py: the catalogue is deterministic per seed, WebShop's reward on hand-worked
products, the teacher solves the episodes with full reward in 5-15 actions, pages and invalid actions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engines.agentic.envs import make_env
from engines.agentic.envs.webshop import Goal, Product, WebShop, make_catalogue, parse_action, search, webshop_reward
from engines.models.modeling import CHARSET
from tests.support.webshop import one_option_short


def test_catalogue_is_deterministic_per_seed():
    a, b, c = make_catalogue(0), make_catalogue(0), make_catalogue(1)
    assert a == b and a != c and len(a) == 16 * 24
    assert len({p.asin for p in a}) == len(a)                                  # ids are unique
    for p in a:
        assert all(att in p.title for att in p.attributes) and p.type in p.title
        assert 2 <= len(p.options) <= 3 and all(len(v) >= 2 for _, v in p.options)
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values))                                 # a click names one option
    env1, env2 = WebShop(), WebShop()
    assert env1.reset(7) == env2.reset(7) and env1.goal == env2.goal
    assert env1.reset(8) != env2.reset(7)


# ------------------------------------------------------------------ reward (WebShop's get_reward)
T = Product("b0target01", "acme waterproof lightweight hiking boots", "acme", "hiking boots",
            ("clothing", "shoes", "hiking boots"), ("waterproof", "lightweight"),
            (("size", ("small", "medium")), ("color", ("black", "red"))), 40.0)
GOAL = Goal(T.asin, ("waterproof", "lightweight"), ("medium", "black"), 50.0, "...")
# denominator |U_att| + |U_opt| + 1 = 2 + 2 + 1 = 5 throughout


def test_reward_on_hand_worked_examples():
    # the target with the asked options: (2 att + 2 opt + 1 price) / 5 = 1
    assert webshop_reward(T, GOAL, T, {"size": "medium", "color": "black"})[0] == pytest.approx(1.0)
    # a wrong size: (2 + 1 + 1) / 5 = 0.8
    assert webshop_reward(T, GOAL, T, {"size": "small", "color": "black"})[0] == pytest.approx(0.8)
    # no option selected: (2 + 0 + 1) / 5 = 0.6
    assert webshop_reward(T, GOAL, T, {})[0] == pytest.approx(0.6)
    # another brand of the same type, one attribute, over the price bound:
    # title_score = |{norla,hiking,boots} ∩ {acme,hiking,boots}| / 3 = 2/3 -> r_type 1; (1 + 2 + 0) / 5 = 0.6
    other = Product("b0other001", "norla waterproof breathable hiking boots", "norla", "hiking boots",
                    ("clothing", "shoes", "hiking boots"), ("waterproof", "breathable"), T.options, 55.0)
    r, parts = webshop_reward(other, GOAL, T, {"size": "medium", "color": "black"})
    assert r == pytest.approx(0.6) and parts["title_score"] == pytest.approx(2 / 3) and not parts["price_ok"]
    # another type of another brand: title_score 0 -> r_type 0, whatever else matches (the category path
    # shares 2 levels, but WebShop zeroes r_type on title_score 0)
    jacket = Product("b0jacket01", "vexo waterproof lightweight rain jacket", "vexo", "rain jacket",
                     ("clothing", "shoes", "rain jacket"), ("waterproof", "lightweight"), T.options, 30.0)
    r, parts = webshop_reward(jacket, GOAL, T, {"size": "medium", "color": "black"})
    assert r == 0.0 and parts["r_type"] == 0.0
    # r_type 0.5: no query or category match and title_score = 1/5 = 0.2 (not > 0.2, not < 0.1);
    # one attribute and the price match: 0.5 · (1 + 0 + 1) / 5 = 0.2
    t5 = Product("b0target05", "acme waterproof lightweight trail hiking boots pro", "acme", "trail hiking boots pro",
                 ("clothing", "shoes", "trail hiking boots pro"), ("waterproof", "lightweight"), T.options, 40.0)
    lamp = Product("b0lamp0001", "acme waterproof desk lamp", "acme", "desk lamp", ("home", "kitchen", "desk lamp"),
                   ("waterproof",), (("color", ("black",)),), 20.0)
    r, parts = webshop_reward(lamp, GOAL, t5, {})
    assert parts["title_score"] == pytest.approx(0.2) and parts["r_type"] == 0.5 and r == pytest.approx(0.2)


def test_an_option_counts_when_it_is_in_the_title():
    # WebShop also looks for a selected option's value in the title: "black" is in this title, so the
    # selected "black" matches even where the goal asked for red: (2 + 1 + 1) / 5 = 0.8
    black = Product("b0black001", "acme black waterproof lightweight hiking boots", "acme", "hiking boots",
                    ("clothing", "shoes", "hiking boots"), ("waterproof", "lightweight"), T.options, 40.0)
    goal = Goal(black.asin, ("waterproof", "lightweight"), ("small", "red"), 50.0, "...")
    assert webshop_reward(black, goal, black, {"color": "black"})[0] == pytest.approx(0.8)


# ------------------------------------------------------------------ teacher
@pytest.mark.parametrize("kwargs", [{}, {"page_size": 3, "brackets": "()", "repeat_instruction": False}])
def test_teacher_solves_with_full_reward_in_5_to_15_actions(kwargs):
    env = make_env("webshop", **kwargs)
    solved, turns = 0, Counter()
    seeds = range(200)
    for seed in seeds:
        env.reset(seed)
        plan = env.solve()
        if plan is None:
            continue
        for k, action in enumerate(plan):
            _, reward, done, info = env.step(action + "\n")
            assert info["valid_action"] and done == (k == len(plan) - 1)
        if info["success"] and reward == pytest.approx(1.0):
            solved += 1
            turns[len(plan)] += 1
    assert solved >= 0.9 * len(seeds), solved
    assert min(turns) >= 5 and max(turns) <= 15, turns


def test_teacher_replans_from_a_wrong_item():
    env = WebShop()
    env.reset(11)
    env.step(env.solve()[0])                                   # search
    wrong = next(p for p in env._shown() if not env._fits(p))  # open a product that cannot earn 1
    env.step(f"click[{wrong.asin}]")
    plan = env.solve()
    assert plan[0] == "click[< prev]"
    for action in plan:
        _, r, done, info = env.step(action)
    assert done and info["success"]


def test_teacher_option_rate_makes_a_teacher_that_sometimes_buys_without_the_options():
    """`teacher_option_rate` < 1: on that share of seeds (drawn from the seed) `solve()` opens the
    same product as the full teacher and buys it without selecting an option, for every point of
    WebShop's score but the options'; the bootstrap corpus (`solved_episodes`) keeps both kinds of
    episode. 1.0 (the default) always selects them. The environment's episodes do not change."""
    from engines.agentic.env_manager import solved_episodes

    kwargs = {"page_size": 3, "repeat_instruction": False}

    def plays(rate, seed):
        env = make_env("webshop", teacher_option_rate=rate, **kwargs)
        env.reset(seed)
        plan = env.solve()
        for action in plan:
            _, reward, done, info = env.step(action)
        goal = env.goal
        assert done and info["valid_action"] and env.teacher_finished(info), (rate, seed, plan)
        if info["success"]:
            return plan, "full"
        assert info["option_matches"] == 0 and info["attribute_matches"] == len(goal.attributes) and info["price_ok"]
        assert reward == pytest.approx((len(goal.attributes) + 1) / (len(goal.attributes) + len(goal.options) + 1))
        return plan, "skipped"

    kinds = [plays(0.5, seed)[1] for seed in range(200)]
    assert 0.35 < kinds.count("skipped") / 200 < 0.65
    assert kinds == [plays(0.5, seed)[1] for seed in range(200)]                  # the same seeds every time
    for seed in range(40):
        full, skipped = plays(1.0, seed), plays(0.0, seed)
        assert full[1] == "full"
        assert skipped[1] == "skipped"
        assert skipped[0] == [a for a in full[0] if not _is_option_click(a)]      # the same search and product
    corpus = solved_episodes("webshop", list(range(20)), max_turns=10,
                             env_kwargs={"teacher_option_rate": 0.5, **kwargs})
    assert len(corpus) == 20
    assert [response.count("click[") for _, response in corpus] == \
        [len(plays(0.5, seed)[0]) - 1 for seed in range(20)]
    with pytest.raises(ValueError, match="teacher_option_rate"):
        make_env("webshop", teacher_option_rate=-0.1)
    env = make_env("webshop", **kwargs)                    # a random purchase is not a finished demonstration
    env.reset(3)
    env.step(env.solve()[0])
    wrong = next(p for p in env._shown() if not env._fits(p))
    env.step(f"click[{wrong.asin}]")
    _, _, done, info = env.step("click[buy now]")
    assert done and not info["success"] and not env.teacher_finished(info)


def _is_option_click(action: str) -> bool:
    return action.startswith("click[") and action[6:-1] not in ("buy now", "< prev", "next >", "back to search") \
        and not action[6:-1].startswith("b0")


# ------------------------------------------------------------------ pages and actions
def test_a_browsing_teacher_opens_what_the_results_page_shows_fits_and_goes_back_from_the_rest():
    """`teacher_browses`: the results page shows titles and prices, not options, so the default teacher
    (which pages straight to the first hit that earns reward 1) demonstrates a choice the policy cannot
    make from what it sees. The browsing teacher opens, in order, the hits whose title and price fit
    the instruction and that it has not opened yet; on an item page without the requested values it
    clicks `< prev`. It still earns reward 1 on every seed, opening only such hits."""
    kwargs = {"page_size": 3, "repeat_instruction": False}
    went_back = 0
    for seed in range(200):
        env = make_env("webshop", teacher_browses=True, **kwargs)
        env.reset(seed)
        plan = env.solve()
        for action in plan:
            if env.page == "results" and action[6:-1] in {p.asin for p in env._shown()}:
                product = env.by_asin[action[6:-1]]
                assert env._looks_right(product) and product.asin not in env.opened, (seed, plan)
                # every hit that looks right and sits before it in the ranking was opened already
                earlier = env.hits[:env.hits.index(product)]
                assert all(p.asin in env.opened for p in earlier if env._looks_right(p)), (seed, plan)
            if action == "click[< prev]" and env.page == "item":
                assert not env._fits(env.by_asin[env.asin])            # it leaves only an item that cannot earn 1
                went_back += 1
            _, reward, done, info = env.step(action)
        assert done and info["success"], (seed, plan)
        assert len(env.opened) == len(set(env.opened))                 # never the same item twice
    assert went_back >= 40                                              # 79 seeds of 200 go back at least once


def test_pages_search_and_pagination():
    env = WebShop(page_size=10)
    obs = env.reset(3)
    assert obs.startswith("instruction: i am looking for ") and "price lower than" in obs and obs.endswith("action: ")
    obs, r, done, info = env.step("search[hiking boots]")
    assert info["valid_action"] and info["effective"] and (r, done) == (0.0, False)
    assert "page 1 of" in obs and len(env._shown()) == 10 and all(p.type == "hiking boots" for p in env._shown())
    assert env.hits == search(env.products, "hiking boots")
    _, _, _, info = env.step("click[next >]")
    assert info["valid_action"] and env.page_no == 1
    _, _, _, info = env.step("CLICK ( < prev )")                # case, spaces and (...) are accepted
    assert info["valid_action"] and env.page_no == 0
    assert parse_action("click[Buy Now]") == ("click", "buy now") and parse_action("buy") is None


def test_a_success_reward_pays_1_for_a_full_score_and_0_for_a_partial_one_and_reports_the_score():
    """`reward="success"`: the same episode pays 1 where the score is 1 and 0 where it is partial (the
    teacher's purchase with its last option click left out); info["score"] is WebShop's r either way."""
    for seed in range(12):
        plan = WebShop(page_size=3)
        plan.reset(seed)
        actions = plan.solve()
        assert actions[-1] == "click[buy now]"
        for cut in (actions, one_option_short(plan, actions)):   # full, then one option short
            ends = {}
            for mode in ("score", "success"):
                env = WebShop(page_size=3, reward=mode)
                env.reset(seed)
                for a in cut:
                    obs, r, done, info = env.step(a)
                assert done and info["valid_action"]
                ends[mode] = (r, info["score"], info["success"], obs)
            (r_score, s1, ok1, _), (r_success, s2, ok2, obs) = ends["score"], ends["success"]
            assert s1 == s2 == r_score and ok1 == ok2 and r_success == float(ok1)
            assert ok1 == (cut is actions) and (r_score == 1.0) == ok1 and 0.0 < r_score
            assert f"webshop score {s1:.2f}" in obs and f"reward {r_success:.2f}" in obs
    with pytest.raises(ValueError, match="reward='partial'"):
        WebShop(reward="partial")


@pytest.mark.parametrize("action", ["buy", "search[]", "click[buy now]", "click[nothing here]", "click[< prev]",
                                    "click[next >]", "jump[x]", "", "search[x] extra", "click[b0zzzzzzzz]"])
def test_invalid_actions_give_an_observation_not_a_crash(action):
    env = WebShop(brackets="()")
    env.reset(5)
    key = env.state_key()
    obs, r, done, info = env.step(action)
    assert obs.startswith("invalid: ") and r == env.invalid_penalty and not done and not info["valid_action"]
    assert env.state_key() == key and set(obs) <= set(CHARSET)


def test_search_only_on_the_search_page_and_buy_ends_the_episode():
    env = WebShop()
    env.reset(2)
    env.step("search[red coffee mug]")
    obs, r, done, info = env.step("search[blue mug]")
    assert obs.startswith("invalid: search only on the search page") and not info["valid_action"]
    env.step(f"click[{env._shown()[0].asin}]")
    obs, r, done, info = env.step("click[buy now]")
    assert done and 0.0 <= r <= 1.0 and obs.startswith("you bought ")
    obs, r, done, info = env.step("click[buy now]")
    assert obs.startswith("invalid: the episode is over") and done
    env.reset(2)
    env.step("search[x y z]")                                  # no hits: an empty page, back to search works
    assert env.hits == [] and env.step("click[back to search]")[3]["valid_action"]


def test_random_policy_never_crashes():
    env = WebShop(page_size=3)
    rng = random.Random(0)
    for seed in range(20):
        env.reset(seed)
        for _ in range(15):
            clickable = [p.asin for p in env._shown()] + ["next >", "< prev", "back to search", "buy now", "black"]
            action = rng.choice([f"click[{rng.choice(clickable)}]", "search[waterproof boots]", "xyz"])
            obs, r, done, info = env.step(action)
            assert isinstance(obs, str) and set(info) >= {"valid_action", "effective", "success"}
            if done:
                assert 0.0 <= r <= 1.0
                break
