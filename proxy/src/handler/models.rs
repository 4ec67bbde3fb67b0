//! `GET /v1/models` and `GET /v1/models/{id}`, answered by the proxy itself:
//! every model and alias, with its state in the extra `siesta_state` field.

use http::Response;
use http::StatusCode;
use serde_json::{Value, json};

use crate::body::ProxyBody;
use crate::errors::{ApiError, json_response};
use crate::handler::Shared;
use crate::hold::state_name;
use crate::route_table::ModelRoute;

fn entry(route: &ModelRoute, id: &str) -> Value {
    let mut v = json!({
        "id": id,
        "object": "model",
        "created": route.status.state_since_unix_ms / 1000,
        "owned_by": "siesta",
        "root": route.status.model,
        "siesta_state": state_name(route.state),
    });
    if id != &*route.name {
        v["siesta_alias_of"] = Value::from(&*route.name);
    }
    v
}

pub fn list(shared: &Shared) -> Response<ProxyBody> {
    let view = shared.table.view();
    let mut data = Vec::new();
    for r in &view.models {
        data.push(entry(r, &r.name));
        for a in &r.aliases {
            if view
                .by_name
                .get(a)
                .is_some_and(|x| std::ptr::eq(&**x, &**r))
            {
                data.push(entry(r, a));
            }
        }
    }
    json_response(
        StatusCode::OK,
        json!({"object": "list", "data": data}).to_string(),
    )
}

pub fn one(shared: &Shared, id: &str) -> Response<ProxyBody> {
    let view = shared.table.view();
    match view.by_name.get(id) {
        Some(r) => json_response(StatusCode::OK, entry(r, id).to_string()),
        None => ApiError::UnknownModel(crate::errors::shown(id)).into_response(),
    }
}
