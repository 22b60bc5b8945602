"""Write tickets.jsonl: each ticket asked twice, once for its label (choices, with
logprobs as the label's confidence) and once for its fields (a JSON schema); the first
six also get three drafted first lines of a reply (n = 3, sampled; one prompt prefill).

    python examples/tickets/make_tickets.py
"""

import json
from pathlib import Path

TICKETS = [
    "I was charged twice for March. Please refund one of the payments.",
    "The timesheet page shows a blank screen since this morning and my team cannot log hours.",
    "Could you add a dark mode? My eyes hurt after a long day.",
    "I forgot my password and the reset email never arrives.",
    "Your product is great, thanks to the whole team!",
    "The PDF invoice export fails with error 500 for every client.",
    "How do I move from the Team plan to Business in the middle of the month?",
    "Please let us set different hourly rates per task, not only per project.",
    "Our single sign-on with Okta stopped working after we renamed our domain.",
    "The Gantt chart puts tasks on the wrong day when I am in New Zealand.",
    "Can I pay by bank transfer instead of credit card?",
    "The Xero sync stopped two days ago; invoices are not arriving in Xero.",
    "I would like a weekly email with the hours of each project.",
    "Please remove my former colleague's account, she left the company.",
    "Do you have an office in Germany? We would like to visit.",
    "The mobile app logs me out every time I switch to another app.",
    "Our payroll export shows 0 hours for everyone, payroll runs tomorrow!",
    "Add a Kanban board view to projects, please.",
    "Why is VAT added to my invoice? We are a business in another EU country.",
    "Two-factor codes from my authenticator app are always rejected.",
    "Recurring tasks are created twice every Monday.",
    "We want to become a reseller of Tidemark in Spain.",
    "Budgets in the project overview do not add up to the total on the dashboard.",
    "Let admins lock timesheets after they are approved.",
]
LABELS = ["billing", "bug", "feature", "account", "other"]
FIELDS = {
    "type": "object",
    "properties": {
        "urgency": {"type": "string", "enum": ["high", "normal", "low"]},
        "area": {"type": "string",
                 "enum": ["timesheets", "projects", "gantt", "invoicing", "integrations", "mobile", "admin", "other"]},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["urgency", "area", "summary"],
    "additionalProperties": False,
}


def rows():
    for i, text in enumerate(TICKETS):
        yield {"id": f"t{i:03d}-label", "prompt": f"Ticket: {text}\nLabel it with one of: {', '.join(LABELS)}.",
               "choices": LABELS, "logprobs": True, "top_logprobs": 3, "max_tokens": 12, "temperature": 0}
        yield {"id": f"t{i:03d}-fields", "prompt": f"Ticket: {text}\nGive its urgency, area and a short summary.",
               "json_schema": FIELDS, "max_tokens": 64, "temperature": 0}
    for i, text in enumerate(TICKETS[:6]):
        yield {"id": f"t{i:03d}-drafts", "prompt": f"Ticket: {text}\nDraft the first line of a reply.",
               "n": 3, "temperature": 0.8, "seed": i, "max_tokens": 24}


if __name__ == "__main__":
    out = Path(__file__).with_name("tickets.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    print(f"wrote {out}")
