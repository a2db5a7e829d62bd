use super::{credits, date, templates, utc};

#[test]
fn dates_times_and_amounts_render_exactly() {
    assert_eq!(date(0), "1970-01-01");
    assert_eq!(date(20_424), "2025-12-02");
    assert_eq!(utc(1_764_633_600_000 + 3_723_000), "2025-12-02 01:02:03");
    assert_eq!(credits(1_234_567), "1.234567");
    assert_eq!(credits(5), "0.000005");
}

#[test]
fn every_template_parses_and_escapes() -> Result<(), minijinja::Error> {
    let env = templates()?;
    let html = env
        .get_template("error.html")?
        .render(minijinja::context! {
            status => 404, message => "<script>x</script>", user => None::<()>, csrf => "",
        })?;
    assert!(
        html.contains("&lt;script&gt;x&lt;&#x2f;script&gt;"),
        "{html}"
    );
    assert!(!html.contains("<script>x"));
    Ok(())
}

/// A request-log page whose search found no more matches in its bound of records says so
/// and links to the older ones (a plain link); a last page has no link.
#[test]
fn a_searched_request_page_links_to_older_records() -> Result<(), minijinja::Error> {
    let env = templates()?;
    let render = |next: Option<&str>, searched: Option<&str>| {
        env.get_template("requests.html")?
            .render(minijinja::context! {
                user => minijinja::context! { email => "b@x", role => "builder", owner => "a" },
                csrf => "", rows => Vec::<()>::new(), next => next, searched => searched,
                keys => Vec::<(String, String)>::new(), day => None::<String>,
                filter => minijinja::context! { key_hash => "k", model => None::<String>, outcome => None::<String> },
                outcomes => ["completed"], models => ["m"],
            })
    };
    let html = render(Some("after=5.r&key=k"), Some("10,000"))?;
    assert!(
        html.contains("No more matches in the last 10,000 requests searched — <a href=\"/console/requests?after=5.r&amp;key=k\" id=\"older\">search older →</a>"),
        "{html}"
    );
    let html = render(None, None)?;
    assert!(!html.contains("id=\"older\""), "{html}");
    assert!(html.contains("No requests match."), "{html}");
    Ok(())
}
