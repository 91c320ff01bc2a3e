#!/usr/bin/env python
"""Structured outputs and forced tool calls as a new user meets them: the official `openai`
client against a local cluster serving the embedded model.

    parse       client.beta.chat.completions.parse(response_format=Model) for COUNT varied prompts,
                over several Pydantic models (strings, integers, enums, lists, nested objects):
                how many come back with message.parsed, an instance of the model
    tool calls  the same client with tools=[openai.pydantic_function_tool(Model), ...] and the
                function named in tool_choice (every other request: tool_choice "required" with
                parallel_tool_calls false, one call): how many come back with their calls'
                function.parsed_arguments, instances of the models
    parallel    tool_choice "required" with parallel calls allowed (OpenAI's default), on fewer
                prompts: a small model may repeat its call until max_tokens (reported, not required)

Every string and list bounded (maxLength, maxItems), as a schema meant for a small model should be:
an unbounded string lets a model that repeats itself write until max_tokens. max_tokens covers the
longest answer the bounds allow: maxLength counts characters, and a string of emoji (which this
model writes when it repeats itself) takes up to 4 tokens a character. Greedy, at most 16
requests at once; the figures and every failure (with what was written) go to the JSON.

    python bench/openai_structured.py [--count 100] [--json bench/results/openai_structured.json]
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from bench.harness import cpu_name, make_parser, write_json  # noqa: E402


MAX_TOKENS = 2000


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=40)


class Recipe(BaseModel):
    title: str = Field(max_length=60)
    ingredients: list[Annotated[str, Field(max_length=40)]] = Field(min_length=1, max_length=5)
    minutes: int = Field(ge=1, le=600)
    difficulty: Literal["easy", "medium", "hard"]


class Address(BaseModel):
    street: str = Field(max_length=50)
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Company(BaseModel):
    name: str = Field(max_length=50)
    founded: int = Field(ge=1800, le=2030)
    headquarters: Address
    public: bool


class Review(BaseModel):
    product: str = Field(max_length=50)
    stars: int = Field(ge=1, le=5)
    pros: list[Annotated[str, Field(max_length=60)]] = Field(max_length=3)
    cons: list[Annotated[str, Field(max_length=60)]] = Field(max_length=3)


MODELS = [
    (Person, "Invent a person who {}. Give their name, age and city."),
    (Recipe, "Write a short recipe for {}."),
    (Company, "Invent a company that {}. Give its name, founding year, headquarters and whether it is public."),
    (Review, "Write a product review of {}."),
]
TOPICS = ["loves sailing", "tomato soup", "makes bicycles", "a pair of headphones", "grows tea", "pancakes",
          "repairs clocks", "a camping tent", "teaches chess", "lentil curry", "builds bridges", "a coffee grinder",
          "paints murals", "apple pie", "sells maps", "a rain jacket", "studies whales", "fried rice",
          "designs fonts", "a desk lamp", "keeps bees", "a green salad", "brews beer", "a travel mug",
          "collects stamps"]


class GetWeather(BaseModel):
    """The current weather in a city."""
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class BookTable(BaseModel):
    """Book a table at a restaurant."""
    restaurant: str = Field(max_length=50)
    people: int = Field(ge=1, le=20)
    time: str = Field(pattern=r"^[0-2][0-9]:[0-5][0-9]$")


class SendEmail(BaseModel):
    """Send an email."""
    to: str = Field(max_length=60)
    subject: str = Field(max_length=60)
    body: str = Field(max_length=200)


FUNCTIONS = [(GetWeather, "What is the weather like in {}?"),
             (BookTable, "Book a table for dinner for the family in {}."),
             (SendEmail, "Tell my colleague in {} that the meeting moved to Friday.")]
PLACES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Perth", "Cairo", "Hanoi", "Dublin", "Denver",
          "Seville", "Nairobi", "Krakow", "Recife", "Busan", "Tunis", "Leeds", "Bergen", "Mumbai",
          "Tbilisi", "Havana", "Malmo", "Izmir", "Cusco", "Turin", "Austin", "Porto", "Suva", "Hobart",
          "Kyoto", "Accra", "Split", "Riga"]


def parse_cases(count: int) -> list[tuple[type[BaseModel], str]]:
    return [(MODELS[i % len(MODELS)][0], MODELS[i % len(MODELS)][1].format(TOPICS[i % len(TOPICS)]))
            for i in range(count)]


def tool_cases(count: int) -> list[tuple[type[BaseModel], str, bool]]:
    """(function, prompt, named): named in tool_choice, else tool_choice "required"."""
    return [(FUNCTIONS[i % len(FUNCTIONS)][0], FUNCTIONS[i % len(FUNCTIONS)][1].format(PLACES[i % len(PLACES)]),
             i % 2 == 0) for i in range(count)]


def failure(prompt: str, exc: Exception) -> dict:
    """A request that did not parse: why, and what the model wrote when it was cut at max_tokens."""
    out = {"prompt": prompt, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if isinstance(exc, openai.LengthFinishReasonError):
        message = exc.completion.choices[0].message
        out["answer"] = message.content or [c.function.model_dump() for c in message.tool_calls or []]
    return out


async def run_parse(api: openai.AsyncOpenAI, model: str, count: int, concurrency: int = 16) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(schema: type[BaseModel], prompt: str):
        async with gate:
            try:
                answer = await api.beta.chat.completions.parse(
                    model=model, messages=[{"role": "user", "content": prompt}], response_format=schema,
                    temperature=0, max_tokens=MAX_TOKENS)
            except Exception as exc:          # a refusal, a truncation (LengthFinishReasonError), a bad JSON
                return failure(prompt, exc)
            parsed = answer.choices[0].message.parsed
            return None if isinstance(parsed, schema) else {"prompt": prompt, "content": answer.choices[0].message.content}
    results = await asyncio.gather(*(one(s, p) for s, p in parse_cases(count)))
    failures = [r for r in results if r is not None]
    return {"requests": count, "parsed": count - len(failures), "failures": failures}


async def run_tool_calls(api: openai.AsyncOpenAI, model: str, count: int, concurrency: int = 16,
                         parallel: bool = False) -> dict:
    """`parallel`: every request "required" with parallel calls allowed; else half named, half
    "required" with one call."""
    gate = asyncio.Semaphore(concurrency)
    tools = [openai.pydantic_function_tool(f) for f, _ in FUNCTIONS]

    async def one(function: type[BaseModel], prompt: str, named: bool):
        named = named and not parallel
        choice = {"type": "function", "function": {"name": function.__name__}} if named else "required"
        async with gate:
            try:
                answer = await api.beta.chat.completions.parse(
                    model=model, messages=[{"role": "user", "content": prompt}], tools=tools, tool_choice=choice,
                    parallel_tool_calls=parallel, temperature=0, max_tokens=MAX_TOKENS)
            except Exception as exc:
                return failure(prompt, exc)
            calls = answer.choices[0].message.tool_calls or []
            parsed = [c.function.parsed_arguments for c in calls]
            ok = calls and answer.choices[0].finish_reason == "tool_calls" and all(
                isinstance(p, BaseModel) for p in parsed) and (not named or isinstance(parsed[0], function))
            return None if ok else {"prompt": prompt, "tool_calls": [c.model_dump() for c in calls]}
    results = await asyncio.gather(*(one(*case) for case in tool_cases(count)))
    failures = [r for r in results if r is not None]
    return {"requests": count, "parsed": count - len(failures),
            "named": 0 if parallel else sum(c[2] for c in tool_cases(count)), "failures": failures}


async def measure(base_url: str, count: int, parallel: int = 0) -> dict:
    """`parallel`: also that many "required" requests with parallel calls allowed."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as api:
        model = (await api.models.list()).data[0].id
        started = time.perf_counter()
        parse = await run_parse(api, model, count)
        parse["seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        calls = await run_tool_calls(api, model, count)
        calls["seconds"] = time.perf_counter() - started
        result = {"model": model, "parse": parse, "tool_calls": calls}
        if parallel:
            started = time.perf_counter()
            result["parallel_required"] = await run_tool_calls(api, model, parallel, parallel=True)
            result["parallel_required"]["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=24, help='"required" requests with parallel calls allowed')
    args = parser.parse_args()
    from services.common.config import RouterConfig, SchedulerConfig, WorkerConfig, single_pool
    from services.local.cluster import LocalCluster
    config = single_pool(router=RouterConfig(port=0, http_port=0), scheduler=SchedulerConfig(port=0),
                         workers=[WorkerConfig(port=0, threads=1, kv_cache_mb=512)])
    with LocalCluster(config, quiet=True) as cluster:
        router = cluster.config.router
        result = asyncio.run(measure(f"http://{router.host}:{router.http_port}/v1", args.count, args.parallel))
    result.update(cpu=cpu_name(), load_average=os.getloadavg()[0], openai_client=openai.__version__)
    for part in ("parse", "tool_calls", "parallel_required")[:3 if args.parallel else 2]:
        print(f"{part}: {result[part]['parsed']} of {result[part]['requests']} parsed "
              f"({result[part]['seconds']:.0f} s)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
