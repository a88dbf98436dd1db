# Custom tools as rlms's custom_tools_example gives them (functions and data, with
# descriptions), a custom system prompt, and the logger's trajectory on disk.
import json
import pathlib
from datetime import date

from rlm import RLM
from rlm.logger import RLMLogger


def fetch_stock_price(symbol):
    prices = {"AAPL": {"price": 178.5}, "GOOGL": {"price": 141.25}}
    return prices.get(symbol.upper(), {"error": f"Symbol {symbol} not found"})


def format_currency(amount):
    return f"${amount:,.2f}"


def holidays(year):
    return {date(year, 1, 1), date(year, 12, 25)}


logger = RLMLogger(log_dir="./logs")
rlm = RLM(
    backend="openai",
    backend_kwargs={"model_name": "gpt-x"},
    environment="local",
    custom_tools={
        "fetch_stock_price": {"tool": fetch_stock_price, "description": "Price data for a symbol"},
        "format_currency": format_currency,
        "holidays": holidays,
        "MARKET_CONFIG": {
            "tool": {"currency": "USD", "opened": date(1792, 5, 17)},
            "description": "Market facts",
        },
        "SYMBOLS": ("AAPL", "GOOGL"),
    },
    custom_system_prompt="You are a trading desk assistant.{custom_tools_section}",
    logger=logger,
)
result = rlm.completion("Tools question", root_prompt="Tools question")
print("Response:", result.response)
trajectory = result.metadata
print("Run metadata:", sorted(trajectory["run_metadata"]))
print("Iterations:", len(trajectory["iterations"]), sorted(trajectory["iterations"][0]))
print("Block result keys:", sorted(trajectory["iterations"][0]["code_blocks"][0]["result"]))
lines = [
    json.loads(line)
    for path in pathlib.Path("logs").glob("rlm_*.jsonl")
    for line in path.read_text().splitlines()
]
print("Log lines:", [line["type"] for line in lines])
