//! Image folders (`<root>/<label>/<file>.jpg|jpeg|png`) are a listing convention rather than a
//! byte format: the label comes from the file's parent folder, indexed by its position among
//! the sorted distinct folder names, as torchvision's `ImageFolder` does, so label numbers
//! agree with models trained through it. Other files in the listing are ignored, so a stray
//! README does not become a class.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::element::{Element, Field};

const EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// Whether the path names an image the folder format reads (by extension, any case).
pub fn is_image(path: &str) -> bool {
    let base = base_name(path);
    base.rsplit_once('.')
        .is_some_and(|(stem, ext)| !stem.is_empty() && EXTENSIONS.iter().any(|e| ext.eq_ignore_ascii_case(e)))
}

/// Label index for each parent folder name of the images among `paths`.
pub fn label_map(paths: &[String]) -> BTreeMap<String, i64> {
    let mut names: Vec<&str> = paths.iter().filter(|p| is_image(p)).map(|p| parent_name(p)).collect();
    names.sort_unstable();
    names.dedup();
    names.into_iter().zip(0..).map(|(name, i)| (name.to_owned(), i)).collect()
}

/// The element for one image: `image` (the undecoded file bytes) and `label` (`Int64` of one).
/// `None` when the path is not an image or its folder is not in `labels`.
pub fn element(path: &str, bytes: Bytes, labels: &BTreeMap<String, i64>) -> Option<Element> {
    if !is_image(path) {
        return None;
    }
    let label = *labels.get(parent_name(path))?;
    let mut element = Element::new();
    element.insert("image".to_owned(), Field::Bytes(bytes));
    element.insert("label".to_owned(), Field::Int64(vec![label]));
    Some(element)
}

fn base_name(path: &str) -> &str {
    path.rsplit_once('/').map_or(path, |(_, base)| base)
}

/// The folder directly containing the file; "" for a file at the top of the listing.
fn parent_name(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(dir, _)| base_name(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn labels_follow_sorted_folder_names() {
        let listing = paths(&["r/dog/1.jpg", "r/cat/2.PNG", "r/dog/3.jpeg", "r/bird/x.JPG", "r/notes/readme.txt"]);
        let labels = label_map(&listing);
        let expected: BTreeMap<String, i64> =
            [("bird".to_owned(), 0), ("cat".to_owned(), 1), ("dog".to_owned(), 2)].into();
        assert_eq!(labels, expected);
    }

    #[test]
    fn elements_carry_the_bytes_and_label() {
        let labels = label_map(&paths(&["r/a/1.png", "r/b/2.jpg"]));
        let el = element("r/b/2.jpg", Bytes::from_static(b"\xff\xd8"), &labels).expect("an image");
        assert_eq!(el.get("image"), Some(&Field::Bytes(Bytes::from_static(b"\xff\xd8"))));
        assert_eq!(el.get("label"), Some(&Field::Int64(vec![1])));
        assert_eq!(el.len(), 2);
    }

    #[test]
    fn non_images_and_unknown_folders_give_nothing() {
        let labels = label_map(&paths(&["r/a/1.png"]));
        assert!(element("r/a/1.gif", Bytes::new(), &labels).is_none());
        assert!(element("r/a/.png", Bytes::new(), &labels).is_none());
        assert!(element("r/z/1.png", Bytes::new(), &labels).is_none());
        assert!(!is_image("r/a/png"));
        assert!(is_image("r/a/x.JpEg"));
    }
}
