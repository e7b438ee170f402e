from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("demo_shop", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="Run",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True,
                        primary_key=True,
                        serialize=False,
                        verbose_name="ID",
                    ),
                ),
                ("lane", models.CharField(max_length=64)),
                ("key", models.CharField(max_length=255)),
                ("seq", models.IntegerField(default=0)),
                ("behind", models.IntegerField(null=True)),
                ("executed_at", models.DateTimeField()),
            ],
        ),
    ]
