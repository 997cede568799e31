//! Events on a DataPipeline (what `kubectl describe dp` lists): the controller's and the
//! scaling loop's go out the same way.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder};
use stoker_api::DataPipeline;

/// Publishes an event about `dp`; a failure is logged, never returned (an event is a courtesy,
/// not part of reconciling).
pub async fn publish(recorder: &Recorder, dp: &DataPipeline, type_: EventType, reason: &str, action: &str, note: &str) {
    publish_about(recorder, dp, None, type_, reason, action, note).await
}

/// Like [`publish`], naming a second object the event is about (e.g. the ServiceAccount whose
/// calls were refused). Events about different objects are kept apart, not merged.
pub async fn publish_about(
    recorder: &Recorder,
    dp: &DataPipeline,
    secondary: Option<ObjectReference>,
    type_: EventType,
    reason: &str,
    action: &str,
    note: &str,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        // The events API caps notes at 1 kB.
        note: Some(note.chars().take(1000).collect()),
        action: action.into(),
        secondary,
    };
    if let Err(e) = recorder.publish(&event, &dp.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "could not publish an event");
    }
}
