"""`ApiConfig`: the HTTP layer's own section of the deployment config (pydantic, rejects unknown keys).

Mental model: everything the OpenAI front needs to decide *before* a request reaches a backend:
who may call (API key -> tenant; operator keys for /admin/), how big a body may be, which model
names it answers to, and how many tokens to generate when a client names no limit. Cross-field
rules live in one validator.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.semantic import SemanticCacheSettings

MIB = 1 << 20


class ApiConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys: dict[str, str] = Field(
        default_factory=dict, repr=False,  # a logged config must not leak credentials
        description="API key -> tenant name. A tenant may hold several keys.")
    admin_keys: dict[str, str] = Field(
        default_factory=dict, repr=False,
        description="Operator key -> operator name, for /admin/* (routing tables). Its own role: a tenant's "
                    "key is refused there (403) and an operator key is no tenant key on /v1/.")
    auth_required: bool = Field(
        True, description="Refuse /v1/* calls without a known key (401). Off only for a local demo.")
    max_body_bytes: int = Field(MIB, gt=0, description="Larger request bodies are refused with 413.")
    default_tenant: str = Field(
        "default", min_length=1, description="Tenant of calls without a known key when auth is off.")
    served_model_names: list[str] = Field(
        default_factory=list, description="Names clients may put in `model`; empty: the backend's name.")
    default_max_tokens: int = Field(
        256, ge=1, description="Tokens to generate when the request names no limit; lowered to what "
                               "still fits the context after the prompt.")
    health_timeout_s: float = Field(5.0, gt=0, description="A backend health check slower than this is 503.")
    semantic_cache: SemanticCacheSettings | None = Field(
        None, description="Semantic response cache (deploy/semantic.py); absent: off for everyone.")

    @model_validator(mode="after")
    def _check(self) -> "ApiConfig":
        if self.auth_required and not self.api_keys:
            raise ValueError("auth_required is true but api_keys is empty: nobody could call the API "
                             "(add keys, or set auth_required: false for a local demo)")
        for key, tenant in self.api_keys.items():
            if not key or not key.strip() or key != key.strip():
                raise ValueError("api_keys: a key must be non-empty and have no surrounding spaces")
            if not tenant:
                raise ValueError(f"api_keys: the key ending {key[-4:]!r} maps to an empty tenant")
        for key, who in self.admin_keys.items():
            if not key or key != key.strip() or not who:
                raise ValueError("admin_keys: a key must be non-empty, without surrounding spaces, and name "
                                 "its operator")
            if key in self.api_keys:
                raise ValueError(f"admin_keys: the key ending {key[-4:]!r} is also a tenant key; the roles "
                                 "need their own")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served_model_names has duplicates: {self.served_model_names}")
        if any(not name for name in self.served_model_names):
            raise ValueError("served_model_names: a name must be non-empty")
        return self
