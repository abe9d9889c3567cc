"""Example action: where is a customer's order? It asks the shop's API and the bot tells the status.

Put this file in a plugin folder (`[tasks] plugin_dirs = ["plugins", "examples/plugins"]`) and say where
the shop is:

    [task.order_status]
    shop_url = "http://127.0.0.1:8081"   # the shop's API: GET {shop_url}/orders/{order_id}
    timeout_s = 5.0                      # how long the bot waits for it (at most 60)

The shop answers 200 with `{"status": ..., "eta": ...}`, or 404 for an unknown order. The rule fires on
a message with an order number (two letters, a dash, digits) that asks where it is, by its words or by
the `intent` task's `shipping` label, unless it asks to cancel, refund, return or change it. The
field's pattern reads more than the schema allows: a number the schema refuses (AB-123456) never
reaches the shop, and the customer is asked to check it.
"""

from urllib.parse import quote

import aiohttp

from rtserver.tasks import Action, Rule

NAME = "order_status"
DEFAULT_SHOP_URL = "http://127.0.0.1:8081"
PARAMETERS = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}},
    "required": ["order_id"],
    "additionalProperties": False,
}
# Two letters, a dash and digits, not inside a longer word: "#AB-1234", "(ab-1234)".
ORDER_ID = r"(?<![A-Za-z0-9])([A-Za-z]{2}-[0-9]{3,8})(?![A-Za-z0-9-])"
# Words that ask about an order's way to the customer; else the intent task's `shipping` label.
WORDS = (
    r"\b(where|status|track\w*|arriv\w*|deliver\w*|ship\w*|sent|send|dispatch\w*|parcel|package"
    r"|update|look(ed)? up|check|come|came|still|wait\w*|when|on (its|the) way)\b"
)
# Other requests about an order: the model answers them (or, later, their own actions).
UNLESS = r"\b(cancel\w*|refund\w*|return\w*|change\w*|invoice\w*|discount\w*|coupon\w*)\b"


def make_action(options: dict) -> Action:
    shop_url = options.pop("shop_url", DEFAULT_SHOP_URL)
    timeout_s = options.pop("timeout_s", 5.0)
    if options:
        raise ValueError(f"unknown settings: {', '.join(sorted(options))} (known: shop_url, timeout_s)")
    if not isinstance(shop_url, str) or not shop_url.startswith(("http://", "https://")):
        raise ValueError(f"shop_url = {shop_url!r}: an http(s) URL")
    base = shop_url.rstrip("/")

    async def lookup(arguments: dict) -> dict:
        url = f"{base}/orders/{quote(arguments['order_id'])}"
        async with aiohttp.ClientSession() as http, http.get(url) as answer:
            if answer.status == 404:
                return {"found": False}
            if answer.status != 200:
                raise RuntimeError(f"the shop answered HTTP {answer.status}")
            body = await answer.json()
        return {"found": True, "status": str(body["status"]), "eta": body.get("eta")}

    return Action(
        name=NAME,
        description="Look up the delivery status of a customer's order by its number.",
        parameters=PARAMETERS,
        handler=lookup,
        timeout_s=timeout_s,
        rule=Rule(
            fields={"order_id": ORDER_ID},
            intents=("shipping",),
            words=WORDS,
            upper=("order_id",),
            unless=UNLESS,
        ),
        reply=reply,
        invalid_reply="That order number does not look right: it is two letters, a dash and four digits, "
        "like AB-1234. Could you check it?",
    )


def reply(arguments: dict, result: dict) -> str:
    """The bot's sentence, made from the shop's answer (a 135M model would not copy it reliably)."""
    order = arguments["order_id"]
    if not result.get("found"):
        return f"I could not find an order {order}. Could you check the number?"
    eta = f", expected {result['eta']}" if result.get("eta") else ""
    return f"Your order {order} is {result['status']}{eta}."
