"""The administrative endpoints of the control-plane API v1 (docs/API.md "Admin"):
workspaces, stores, attachments, accounts and tokens, as :class:`AdminEndpoints`, the base
of :class:`~memfuse.client.api.ApiClient` (which adds the records and feeds endpoints).
"""
from __future__ import annotations

from typing import Any

from ..defs import Access
from ..wire import (
    Attachment,
    AttachmentPut,
    Store,
    StoreCreate,
    StoreUpdate,
    TokenCreate,
    TokenCreated,
    TokenInfo,
    Workspace,
    WorkspaceCreate,
    Account,
    AccountCreate,
    AccountUpdate,
    build,
)
from .base import (
    ApiSession,
    _seg,
    _STORES,
    _WORKSPACES,
    _ACCOUNTS,
    _TOKENS,
)


class AdminEndpoints(ApiSession):
    """The admin endpoints of :class:`~memfuse.client.api.ApiClient` (workspaces, stores,
    attachments, accounts, tokens); every method raises as ``ApiClient``'s do."""

    # ------------------------------------------------------------ admin

    async def create_workspace(
        self, name: str, idempotency_key: str | None = None, *, default_store: bool = True,
        account: str | None = None,
    ) -> Workspace:
        """``POST /v1/workspaces`` (admin); with ``default_store`` the server also creates a
        store named ``name`` (or takes the existing one) and attaches it read-write; in
        ``account`` when given (the root admin's choice; None: the caller's). Raises
        Conflict (``exists``), NotFound (``account_not_found``)."""
        fields: dict[str, Any] = {"name": name, "default_store": default_store}
        if account is not None:
            fields["account"] = account
        return await self._call(
            Workspace,
            "POST",
            "/v1/workspaces",
            body=build(WorkspaceCreate, **fields),
            idempotency_key=idempotency_key,
        )

    async def list_workspaces(self) -> list[Workspace]:
        """``GET /v1/workspaces`` (admin)."""
        return await self._call(_WORKSPACES, "GET", "/v1/workspaces")

    async def create_store(
        self,
        slug: str,
        description: str = "",
        default_type: str = "project",
        max_record_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_records: int | None = None,
        idempotency_key: str | None = None,
        *,
        max_history_bytes: int | None = None,
        max_history_versions: int | None = None,
        history_min_age_s: int | None = None,
        account: str | None = None,
    ) -> Store:
        """``POST /v1/stores`` (admin), in ``account`` when given (the root admin's choice;
        None: the caller's). Limits left ``None`` take the server defaults (1 MiB,
        64 MiB, 10,000; the history budget: 16 x max_store_bytes, 16 x max_records, 24 h).
        Raises Conflict (``exists``: the account has a store of that slug), NotFound
        (``account_not_found``); ``ValueError``
        (``msgspec.ValidationError``, before any request) for a bad slug, type or limit."""
        fields: dict[str, Any] = {"slug": slug, "description": description, "default_type": default_type}
        if account is not None:
            fields["account"] = account
        for k, v in (
            ("max_record_bytes", max_record_bytes),
            ("max_store_bytes", max_store_bytes),
            ("max_records", max_records),
            ("max_history_bytes", max_history_bytes),
            ("max_history_versions", max_history_versions),
            ("history_min_age_s", history_min_age_s),
        ):
            if v is not None:
                fields[k] = v
        return await self._call(
            Store, "POST", "/v1/stores", body=build(StoreCreate, **fields), idempotency_key=idempotency_key
        )

    async def list_stores(self) -> list[Store]:
        """``GET /v1/stores`` (admin): every store."""
        return await self._call(_STORES, "GET", "/v1/stores")

    async def get_store(self, slug: str) -> Store:
        """``GET /v1/stores/{slug}`` (admin or an attached workspace). Raises NotFound."""
        return await self._call(Store, "GET", f"/v1/stores/{_seg(slug)}")

    async def update_store(
        self,
        slug: str,
        *,
        description: str | None = None,
        default_type: str | None = None,
        max_record_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_records: int | None = None,
        idempotency_key: str | None = None,
        max_history_bytes: int | None = None,
        max_history_versions: int | None = None,
        history_min_age_s: int | None = None,
    ) -> Store:
        """``PATCH /v1/stores/{slug}`` (admin): change only the fields given (not ``None``):
        the limits, and the history budget (``max_history_bytes``, ``max_history_versions``,
        ``history_min_age_s``: docs/SEMANTICS.md "History budget").
        Raises ``ValueError`` (``msgspec.ValidationError``, before any request) for a bad type
        or limit."""
        update = build(
            StoreUpdate,
            description=description,
            default_type=default_type,
            max_record_bytes=max_record_bytes,
            max_store_bytes=max_store_bytes,
            max_records=max_records,
            max_history_bytes=max_history_bytes,
            max_history_versions=max_history_versions,
            history_min_age_s=history_min_age_s,
        )
        return await self._call(
            Store,
            "PATCH",
            f"/v1/stores/{_seg(slug)}",
            body=update,
            exclude_none=True,
            idempotency_key=idempotency_key,
        )

    async def attach(
        self,
        ws: str,
        store: str,
        access: Access | str = Access.read_write,
        instructions: str = "",
        idempotency_key: str | None = None,
    ) -> Attachment:
        """``PUT /v1/workspaces/{ws}/attachments/{store}`` (admin): attach or change access.
        Raises NotFound (``workspace_not_found``, ``store_not_found``)."""
        return await self._call(
            Attachment,
            "PUT",
            f"/v1/workspaces/{_seg(ws)}/attachments/{_seg(store)}",
            body=build(AttachmentPut, access=Access(access), instructions=instructions),
            idempotency_key=idempotency_key,
        )

    async def create_account(self, slug: str, max_stores: int | None = None, max_bytes: int | None = None,
                             max_tokens: int | None = None, idempotency_key: str | None = None) -> Account:
        """``POST /v1/accounts`` (root admin): a new account with its quotas (None:
        unlimited). Raises Conflict (``exists``), Forbidden unless the root admin."""
        return await self._call(
            Account, "POST", "/v1/accounts",
            body=build(AccountCreate, slug=slug, max_stores=max_stores, max_bytes=max_bytes,
                       max_tokens=max_tokens),
            idempotency_key=idempotency_key,
        )

    async def list_accounts(self) -> list[Account]:
        """``GET /v1/accounts`` (admin): every account with quotas and usage (an account
        admin: its own)."""
        return await self._call(_ACCOUNTS, "GET", "/v1/accounts")

    async def get_account(self, slug: str) -> Account:
        """``GET /v1/accounts/{account}``. Raises NotFound (``account_not_found``)."""
        return await self._call(Account, "GET", f"/v1/accounts/{_seg(slug)}")

    async def update_account(self, slug: str, quotas: dict[str, int | None],
                             idempotency_key: str | None = None) -> Account:
        """``PATCH /v1/accounts/{account}`` (root admin): set the quotas in ``quotas``
        (``max_stores``, ``max_bytes``, ``max_tokens``: a number, or None for unlimited);
        the ones left out are kept. Raises NotFound (``account_not_found``), Forbidden
        unless the root admin, ``ValueError`` (before any request) for a bad quota."""
        return await self._call(
            Account, "PATCH", f"/v1/accounts/{_seg(slug)}",
            body=build(AccountUpdate, **quotas), idempotency_key=idempotency_key,
        )

    async def delete_account(self, slug: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/accounts/{account}`` (root admin): an empty account. Raises
        Conflict (``account_not_empty``), NotFound."""
        await self._request("DELETE", f"/v1/accounts/{_seg(slug)}", idempotency_key=idempotency_key)

    async def attach_account(self, account: str, store: str, access: Access | str = Access.read_write,
                             idempotency_key: str | None = None) -> Attachment:
        """``PUT /v1/accounts/{account}/attachments/{store}``: attach ``store`` to every
        workspace of the account, existing and new."""
        return await self._call(
            Attachment, "PUT", f"/v1/accounts/{_seg(account)}/attachments/{_seg(store)}",
            body=build(AttachmentPut, access=Access(access)), idempotency_key=idempotency_key,
        )

    async def detach_account(self, account: str, store: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/accounts/{account}/attachments/{store}``: detach it everywhere."""
        await self._request("DELETE", f"/v1/accounts/{_seg(account)}/attachments/{_seg(store)}",
                            idempotency_key=idempotency_key)

    async def detach(self, ws: str, store: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/workspaces/{ws}/attachments/{store}`` (admin). Raises NotFound when
        not attached."""
        await self._request(
            "DELETE",
            f"/v1/workspaces/{_seg(ws)}/attachments/{_seg(store)}",
            idempotency_key=idempotency_key,
        )

    async def create_token(
        self, workspace: str | None = None, name: str = "", idempotency_key: str | None = None,
        ttl_seconds: int | None = None, account: str | None = None,
    ) -> TokenCreated:
        """``POST /v1/tokens`` (admin): a token for ``workspace``, or an admin token when
        ``None``; with ``ttl_seconds`` it expires that long after creation (``.expires_at``).
        The raw token is in ``.token`` and is shown only once. With ``account`` and no
        ``workspace``: an admin token of that account only. Raises NotFound
        (``workspace_not_found``, ``account_not_found``), Forbidden for a workspace token."""
        return await self._call(
            TokenCreated,
            "POST",
            "/v1/tokens",
            body=build(TokenCreate, workspace=workspace, name=name, ttl_seconds=ttl_seconds,
                       account=account),
            idempotency_key=idempotency_key,
            exclude_none=ttl_seconds is None,
        )

    async def list_tokens(self, workspace: str | None = None,
                          include_revoked: bool = False) -> list[TokenInfo]:
        """``GET /v1/tokens`` (admin): every token, oldest first, never its secret;
        ``workspace`` keeps one workspace's (``""``: admin tokens only); revoked ones only
        with ``include_revoked``. Raises Forbidden for a workspace token."""
        params: dict[str, Any] = {}
        if workspace is not None:
            params["workspace"] = workspace
        if include_revoked:
            params["include_revoked"] = "true"
        return await self._call(_TOKENS, "GET", "/v1/tokens", params=params or None)

    async def revoke_token(self, token_id: str, idempotency_key: str | None = None) -> None:
        """``DELETE /v1/tokens/{id}`` (admin): the token stops working at once (on every
        replica within about a second). Revoking a revoked token succeeds. Raises NotFound
        (``token_not_found``), Forbidden for a workspace token."""
        await self._request("DELETE", f"/v1/tokens/{_seg(token_id)}",
                            idempotency_key=idempotency_key)
