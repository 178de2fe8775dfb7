"""Structured-output tests; SCHEMA is the JSON schema they share."""

# Nested object, enum, bounded array and strings, required fields: every string and list
# is bounded, so even a random model's constrained output ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 6},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
